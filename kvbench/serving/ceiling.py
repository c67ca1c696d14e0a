"""The ceiling a load benchmark's gain is measured against: what batching alone gives on this machine.

transformers' own `generate` (greedy, its dense `DynamicCache`, no kvbench capture or cache) runs the same model on
`batch` prompts of one length (cut to the shortest, so no padding) for exactly `new_tokens` tokens each: its output
tokens/s at batch M (the compressed method's admitted concurrency) over batch N (the full cache's) is the most a
scheduler that runs M requests where the full cache runs N could gain, at those lengths, with no compression cost and
no gain from a shorter cache. `hf_batch` also returns the tokens, so a test can check that each prompt's greedy
tokens at batch M and N are its tokens at batch 1 (the comparison is fair: the same work at each batch size)."""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HFBatch:
    """One `generate` call: `batch` prompts of `prompt_len` tokens, `new_tokens` each."""

    batch: int
    prompt_len: int
    new_tokens: int
    seconds: float  # the whole call: the batched prefill and every decode step
    prefill_s: float  # until the first new tokens existed (the batched prefill), in the same call
    tokens: list[list[int]]  # each prompt's generated ids
    margins: list[list[float]]  # each step's gap between the two highest logits, per prompt (ties: near 0)

    @property
    def tok_s(self) -> float:
        """Output tokens/s, prefill included (what a request waits for)."""
        return self.batch * self.new_tokens / self.seconds

    @property
    def decode_tok_s(self) -> float:
        """Output tokens/s of the decode steps alone (the tokens after the first)."""
        return self.batch * (self.new_tokens - 1) / max(self.seconds - self.prefill_s, 1e-9)


class FirstToken:
    """A `generate` streamer that notes when the first new tokens exist (its second `put`; the first is the
    prompt): the prefill's end, timed inside the same call as the decode steps."""

    def __init__(self):
        self.puts, self.at = 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


def _generate(model, ids: torch.Tensor, new_tokens: int, streamer=None):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, num_beams=1, use_cache=True,
                          pad_token_id=model.generation_config.eos_token_id or 0, return_dict_in_generate=True,
                          output_scores=True, temperature=None, top_p=None, top_k=None, streamer=streamer)


@torch.no_grad()
def hf_batch(model, prompts: Sequence[Sequence[int]], batch: int, new_tokens: int) -> HFBatch:
    """transformers' `generate` on the first `batch` prompts, cut to the shortest of them, `new_tokens` each
    (EOS suppressed until then, so every batch size does the same work)."""
    if not 1 <= batch <= len(prompts):
        raise ValueError(f"ceiling: batch {batch} needs 1..{len(prompts)} prompts")
    length = min(len(p) for p in prompts[:batch])
    ids = torch.tensor([list(p[:length]) for p in prompts[:batch]], device=model.device)
    first = FirstToken()
    t0 = time.perf_counter()
    out = _generate(model, ids, new_tokens, streamer=first)
    seconds = time.perf_counter() - t0
    prefill_s = first.at - t0
    tokens = out.sequences[:, length:].tolist()
    top2 = torch.stack([s.float().topk(2, dim=-1).values for s in out.scores], dim=1)  # [batch, steps, 2]
    margins = (top2[..., 0] - top2[..., 1]).tolist()
    return HFBatch(batch, length, new_tokens, seconds, prefill_s, tokens, margins)


def same_greedy_tokens(alone: HFBatch, together: HFBatch, row: int, tie: float = 1e-4) -> bool:
    """Prompt `row`'s tokens in `together` equal its tokens generated alone (`alone`, batch 1), up to the first
    step where batch 1's top two logits are within `tie` (after a near-tie either token is a correct argmax)."""
    mine, theirs = alone.tokens[0], together.tokens[row]
    for t, (a, b) in enumerate(zip(mine, theirs)):
        if alone.margins[0][t] < tie:
            return True
        if a != b:
            return False
    return True


@dataclass(frozen=True)
class Ceiling:
    """transformers' batch-M over batch-N speed-up, each size's best of `reps` calls."""

    m: HFBatch
    n: HFBatch

    @property
    def ratio(self) -> float:
        return self.m.tok_s / self.n.tok_s

    @property
    def decode_ratio(self) -> float:
        return self.m.decode_tok_s / self.n.decode_tok_s


def ceiling(model, prompts: Sequence[Sequence[int]], m: int, n: int, new_tokens_m: int, new_tokens_n: int,
            reps: int = 2) -> Ceiling:
    """Batch `m` (with `new_tokens_m` each) over batch `n` (`new_tokens_n`), alternating sizes between reps (m n, then
    n m, ...) so a neighbour's load hits both, each size's fastest call kept."""
    best: list[HFBatch | None] = [None, None]
    sizes = ((m, new_tokens_m), (n, new_tokens_n))
    for rep in range(reps):
        for i in ((0, 1) if rep % 2 == 0 else (1, 0)):
            got = hf_batch(model, prompts, *sizes[i])
            if best[i] is None or got.seconds < best[i].seconds:
                best[i] = got
    return Ceiling(best[0], best[1])
