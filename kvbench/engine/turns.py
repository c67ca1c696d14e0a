"""A conversation over one compressed context: several questions, one after another (`dataset.turns`).

The first turn is an ordinary sample (`generation.prepare`: prefill, compress, and with `question_len` the question
fed on top), decoded by the engine's step. Each later turn's tokens are fed with `generation.feed` (the prefill
function, as a chunk: no new model call site) and decoded again, either on the live cache after the previous answer
(`append`: the answer's last token, which decoding chose but never fed, goes first; the conversation grows on one
cache, as SCBench's multi-turn mode) or on a copy of the cache as compression left it (`reset`: every turn starts
from the same compressed prompt). Nothing new is selected after the first turn: methods that evict while decoding
score each fed turn's rows into their accumulated scores, as at prefill, and evict to their budget right after it
(`EvictionState.chunk`), then go on evicting at every step; the others keep every fed token. Positions stay
original (a turn's tokens follow everything the cache has seen). Greedy or sampled as configured.

Several conversations decode together (`converse_many`, `batch_size` > 1) through the engine's batched step: each
turn is a `batching.Request` whose join feeds the turn on the conversation's cache (its first: the prefill and
compression), and whose `then` gives the next turn's request once its answer is done; that request is admitted
before any new conversation, so a conversation rejoins the batch while the others go on decoding, and at most
`batch_size` caches are held (plus, in `reset` mode, each one's compressed copy). Batch size 1 is a batch of one:
conversation after conversation, turn after turn. An answer's tokens and accounting are batch 1's (up to the
batched step's rounding, `kvbench.engine.batching`), whatever order the turns of different conversations finish in.
"""
from __future__ import annotations

import copy
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from kvbench.engine.batching import BatchedDecoder, Request
from kvbench.engine.generation import EvictionHook, Generation, Prepared, Sampling, feed, prepare
from kvbench.methods.base import Method
from kvbench.models.capture import AttentionCapture


@dataclass(frozen=True)
class Limits:
    """When one answer ends: its dataset sample's fields of the same names (see `kvbench.data.base.Sample`)."""

    max_new_tokens: int
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    min_new_tokens: int = 0


@dataclass(eq=False)
class Conversation:
    """One conversation to play: turn 0 answers `first_ids` (its last `question_len` tokens fed after compression
    under `query=agnostic`), turn k >= 1 answers `turns[k - 1]` (token ids: the follow-up in `append` mode, the
    question part in `reset` mode). Each turn ends by its own `per_turn[k]` limits (None: `max_new_tokens` and
    `stop` for every turn). `tag` travels with it back to the caller."""

    first_ids: list[int]
    turns: list[list[int]]
    budget: int | None
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    mode: str = "append"
    question_len: int = 0
    seed: int = 0
    tag: object = None
    per_turn: list[Limits] | None = None

    def __post_init__(self):
        if self.mode not in ("append", "reset"):
            raise ValueError(f"turn_mode={self.mode!r} is not one of append, reset")
        if self.per_turn is not None and len(self.per_turn) != len(self.turns) + 1:
            raise ValueError(f"{len(self.per_turn)} turn limits for {len(self.turns) + 1} turns")

    def limits(self, k: int) -> Limits:
        return self.per_turn[k] if self.per_turn is not None else Limits(self.max_new_tokens, tuple(self.stop))


def converse(model, tokenizer, method: Method, capture: AttentionCapture, first_ids: Tensor, turns: list[list[int]],
             budget: int | None, max_new_tokens: int, stop: tuple[str, ...] = (), mode: str = "append",
             question_len: int = 0, sampling: Sampling = Sampling(), positions: str = "original", seed: int = 0,
             compress_after: str = "layer", per_turn: list[Limits] | None = None) -> Iterator[Generation]:
    """Yield one Generation per turn of one conversation (see `Conversation`; `first_ids` `[1, n]`). `kv_bytes` of a
    turn is what the cache held when its decoding began. A failure raises."""
    conversation = Conversation(first_ids[0].tolist(), turns, budget, max_new_tokens, tuple(stop), mode,
                                question_len, seed, per_turn=per_turn)
    for _, _, outcome in converse_many(model, tokenizer, method, capture, [conversation], 1, sampling, positions,
                                       compress_after):
        if isinstance(outcome, Exception):
            raise outcome
        yield outcome


def converse_many(model, tokenizer, method: Method, capture: AttentionCapture,
                  conversations: Iterable[Conversation], batch_size: int, sampling: Sampling = Sampling(),
                  positions: str = "original", compress_after: str = "layer",
                  ) -> Iterator[tuple[Conversation, int, Generation | Exception]]:
    """Play every conversation, `batch_size` answers decoding at once (see the module docstring); yield
    (conversation, turn, generation) as each answer finishes, or (conversation, turn, exception) for the turn whose
    feed, prefill or decoding raised: that conversation ends there, the others go on."""
    decoder = BatchedDecoder(model, tokenizer, method, capture, batch_size, sampling, positions,
                             compress_after=compress_after)
    firsts = (_Playing(c, model, method, capture, positions, compress_after).request(0) for c in conversations)
    for request, outcome in decoder.run(firsts):
        playing, k = request.tag
        yield playing.conversation, k, outcome


class _Playing:
    """A conversation being played: its cache between turns, and the request of each turn in turn."""

    def __init__(self, conversation: Conversation, model, method: Method, capture: AttentionCapture, positions: str,
                 compress_after: str):
        self.conversation, self.model, self.method, self.capture = conversation, model, method, capture
        self.positions, self.compress_after = positions, compress_after
        c, n = conversation, len(conversation.first_ids)
        # reset under query=agnostic: the compressed prompt is the context alone, and every turn (the first too)
        # feeds its question on a copy of it
        self.split_first = c.mode == "reset" and c.question_len > 0
        self.feeds = [c.first_ids[n - c.question_len:] if self.split_first else None, *c.turns]
        self.run: Prepared | None = None
        self.compressed: Prepared | None = None  # reset: the cache as compression left it
        self.hooks: tuple = (None, None)  # the decode and input hooks compression left on the capture
        self.previous: Generation | None = None

    def request(self, k: int) -> Request:
        c, limits = self.conversation, self.conversation.limits(k)
        then = (lambda gen: self._answered(k, gen)) if k + 1 < len(self.feeds) else None
        return Request(None, c.budget, limits.max_new_tokens, limits.stop, limits.stop_token_ids,
                       limits.min_new_tokens, c.seed, tag=(self, k), on_join=lambda: self._join(k), then=then)

    def _answered(self, k: int, gen: Generation) -> Request:
        self.previous = gen
        return self.request(k + 1)

    def _join(self, k: int) -> Prepared:
        """Turn k's cache, ready to decode, with its hooks on the capture: turn 0 prefilled and compressed, a later
        turn's tokens fed on the live cache (append) or on a copy of the compressed one (reset)."""
        c, capture = self.conversation, self.capture
        if k == 0:
            n, q = len(c.first_ids), c.question_len
            ids = torch.tensor([c.first_ids[:n - q] if self.split_first else c.first_ids],
                               device=next(self.model.parameters()).device)
            self.run = prepare(self.model, self.method, capture, ids, c.budget, c.limits(0).max_new_tokens,
                               self.positions, c.seed, self.compress_after, question_len=0 if self.split_first else q)
            self.hooks = (capture.decode_hook, capture.input_hook)
            self.compressed = copy.deepcopy(self.run) if c.mode == "reset" else None
        tokens = self.feeds[k]
        if c.mode == "reset" and tokens is not None:
            self.run = copy.deepcopy(self.compressed)
        _attach(capture, self.method, self.run, *self.hooks)  # (a batch of one forgets the hooks when it ends)
        if tokens is not None:
            if self.run.ledger is not None:  # a storage method's transfers: each turn reports its own feed and steps
                self.run.ledger.restart()
            unanswered = unfed(self.run, self.previous) if c.mode == "append" and self.previous is not None else []
            self.run = _feed(self.model, capture, self.run, unanswered + tokens, self.positions)
        return self.run


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
        hook = EvictionHook(run.state, run.cache, hook.fixed, hook.softcap, hook.sinks)
    if hasattr(inputs, "rebind"):  # StepStart, TailorKV's Prefetch
        inputs = inputs.rebind(run.cache.layers, run.ledger)
    capture.cache, capture.decode_hook, capture.input_hook = run.cache, hook, inputs
    capture.logit_scale = getattr(method, "logit_scale", None)
