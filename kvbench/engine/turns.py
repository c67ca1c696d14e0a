"""A conversation over one compressed context: several questions, one after another (`dataset.turns`).

The first turn is an ordinary sample (`generation.prepare`: prefill, compress, and with `question_len` the question
fed on top), decoded by the engine's step. Each later turn's tokens are fed with `generation.feed` (the prefill
function, as a chunk: no new model call site) and decoded again, either on the live cache after the previous answer
(`append`: the answer's last token, which decoding chose but never fed, goes first; the conversation grows on one
cache, as SCBench's multi-turn mode) or on a copy of the cache as compression left it (`reset`: every turn starts
from the same compressed prompt). Nothing new is selected after the first turn: methods that evict while decoding
score each fed turn's rows into their accumulated scores, as at prefill, and evict to their budget right after it
(`EvictionState.chunk`), then go on evicting at every step; the others keep every fed token. Positions stay
original (a turn's tokens follow everything the cache has seen). Batch size 1, greedy or sampled as configured.
"""
from __future__ import annotations

import copy
import time
from collections.abc import Iterator

import torch
from torch import Tensor

from kvbench.cache.ledger import StepStart
from kvbench.engine.batching import decode
from kvbench.engine.generation import (EvictionHook, Generation, Prepared, Sampling, eos_token_ids, feed,
                                       prepare)
from kvbench.methods.base import Method
from kvbench.models.capture import AttentionCapture


def converse(model, tokenizer, method: Method, capture: AttentionCapture, first_ids: Tensor, turns: list[list[int]],
             budget: int | None, max_new_tokens: int, stop: tuple[str, ...] = (), mode: str = "append",
             question_len: int = 0, sampling: Sampling = Sampling(), positions: str = "original", seed: int = 0,
             compress_after: str = "layer") -> Iterator[Generation]:
    """Yield one Generation per turn: turn 0 answers `first_ids` `[1, n]` (its last `question_len` tokens fed after
    compression under `query=agnostic`), turn k >= 1 answers `turns[k - 1]` (token ids: the follow-up in `append`
    mode, the question part in `reset` mode). `kv_bytes` of a turn is what the cache held when its decoding began."""
    if mode not in ("append", "reset"):
        raise ValueError(f"turn_mode={mode!r} is not one of append, reset")
    eos, n = eos_token_ids(model, tokenizer), first_ids.shape[1]
    # reset under query=agnostic: the compressed prompt is the context alone, and every turn (the first too) feeds
    # its question on a copy of it
    split_first = mode == "reset" and question_len > 0
    run = prepare(model, method, capture, first_ids[:, :n - question_len] if split_first else first_ids, budget,
                  max_new_tokens, positions, seed, compress_after, question_len=0 if split_first else question_len)
    hooks, compressed = (capture.decode_hook, capture.input_hook), (copy.deepcopy(run) if mode == "reset" else None)
    previous = None
    for tokens in [first_ids[0, n - question_len:].tolist() if split_first else None, *turns]:
        if mode == "reset" and tokens is not None:
            run = copy.deepcopy(compressed)
        _attach(capture, method, run, *hooks)  # the engine's batch of one forgets the hooks when it ends
        if tokens is not None:
            if run.ledger is not None:  # a storage method's transfers: each turn reports its own feed and steps
                run.ledger.restart()
            run = _feed(model, capture, run, (unfed(run, previous) if mode == "append" else []) + tokens, positions)
        previous = decode(model, tokenizer, method, capture, run, max_new_tokens, eos, stop, positions, sampling)
        previous.timings.update({name: v for name, v in run.timings.items() if name not in previous.timings})
        yield previous


def unfed(run: Prepared, gen: Generation) -> list[int]:
    """The answer tokens decoding chose but never fed (the last one, when a stop string or the length ended it)."""
    fed = run.cache.layers[0].seen_tokens - run.prompt_len  # every fed answer token went through the step
    return gen.token_ids[fed:]


def _feed(model, capture: AttentionCapture, run: Prepared, tokens: list[int], positions: str) -> Prepared:
    """The turn's tokens on top of `run`'s cache; a Prepared whose prompt ends after them. Its `full_kv_bytes` is
    what a full cache of everything seen so far would hold (a dense full cache grows by the same bytes per token), so
    a turn's KV fraction compares like with like."""
    t0 = time.perf_counter()
    logits = feed(model, capture, run.cache, torch.tensor([tokens], device=run.logits.device), positions)
    cache = run.cache
    seen = cache.layers[0].seen_tokens
    return Prepared(cache, logits, seen, run.full_kv_bytes * seen // run.prompt_len, cache.nbytes(),
                    cache.entries_per_head(), [layer.nbytes() for layer in cache.layers], run.ledger,
                    {"prefill_s": time.perf_counter() - t0, "compress_s": 0.0}, run.state)


def _attach(capture: AttentionCapture, method: Method, run: Prepared, hook, inputs) -> None:
    """Point the capture at `run`'s cache: its decode-time evictor's hook (rebuilt on a copy's cache and state), a
    storage method's step hook (rebuilt on a copy's layers and ledger), the method's attention temperature."""
    if isinstance(hook, EvictionHook):
        hook = EvictionHook(run.state, run.cache, hook.fixed, hook.softcap)
    if isinstance(inputs, StepStart):
        inputs = StepStart(run.cache.layers, run.ledger)
    capture.cache, capture.decode_hook, capture.input_hook = run.cache, hook, inputs
    capture.logit_scale = getattr(method, "logit_scale", None)
