"""NACL (Chen et al., ACL 2024, "NACL: A General and Effective KV Cache Eviction Framework for LLMs at Inference
Time"): one eviction at encoding time, by proxy tokens plus random eviction. Reference code: Zefan-Cai/KVCache-Factory
`pyramidkv/nacl.py` @ c97f9d7 (`select_nacl_tokens`, `reduce_nacl_proxy_scores`, `select_nacl_proxy_indices`).

Scores: the softmax attention of the proxy tokens (the prompt's last `window` queries, the reference's `proxy_size`
in its `suffix` mode: where a long-context question sits) over every prompt key, summed over the proxy rows. The
proxy positions and the first `sink_size` entries are protected (always kept, inside the budget). Of the rest, the
top (budget - protected - random_budget) by score are kept, then `random_budget` more are drawn without replacement
from the remaining ones with probabilities softmax(score / random_temperature) (uniform when random_temperature <= 0):
NACL's random eviction, which keeps attention from collapsing onto a few heavy tokens.

kvbench specifics (the reference is a selector contract with no model wiring, so its caller decides these):
- GQA: the proxy rows' attention is reduced over each KV group's query heads (`gqa_reduce`) before selection.
- The random draw is reproducible and batch-independent: each (layer, batch row) draws from a generator seeded with
  `seed + layer_idx`, heads in order, as the reference draws from one caller generator at batch 1.
- The reference's `prefix` and `edges` proxy modes are not offered (a question at the end is the benchmarks' layout).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from kvbench.methods.base import LayerView, Method, reduce_groups, window_attention
from kvbench.registry import METHODS


@METHODS.register("nacl")
@dataclass
class NACL(Method):
    window: int = 32  # the proxy tokens: last prompt queries that score the keys, always kept (proxy_size)
    sink_size: int = 0  # first entries always kept (the reference's protected_indices)
    random_budget: int = 0  # entries per head kept by NACL's random eviction instead of by top score
    random_temperature: float = 1.0  # softmax temperature of the random draw's weights; <= 0: uniform
    seed: int = 0  # the random draw's generator seed (+ layer index)
    gqa_reduce: Literal["mean", "max", "sum"] = "mean"  # query heads of a KV group -> one score

    def __post_init__(self):
        if self.window < 1:
            raise ValueError(f"nacl: window={self.window} must be >= 1")
        for field in ("sink_size", "random_budget", "seed"):
            if getattr(self, field) < 0:
                raise ValueError(f"nacl: {field}={getattr(self, field)} must be >= 0")
        if self.gqa_reduce not in ("mean", "max", "sum"):
            raise ValueError(f"nacl: gqa_reduce={self.gqa_reduce!r} is not one of mean, max, sum")

    @property
    def query_window(self) -> int:
        return self.window

    @property
    def kept_window(self) -> int:
        return self.window

    def check_budget(self, budget: int | None) -> None:
        super().check_budget(budget)
        protected = self.window + self.sink_size
        if budget <= protected:
            raise ValueError(f"nacl: budget={budget} must exceed window + sink_size = {protected} (the protected "
                             f"entries); lower method.window or method.sink_size, or raise budget.")

    def scores(self, view: LayerView) -> Tensor:
        """Attention the proxy rows pay each prompt entry, summed over them: `[B, H_kv, n]`."""
        attn = window_attention(view.window_queries[:, :, -self.window:], view.keys, view.scaling,
                                view.window_bias, view.softcap)
        return reduce_groups(attn.sum(dim=2), view.keys.shape[1], self.gqa_reduce)

    def select(self, view: LayerView, n_keep: int) -> Tensor:
        scores = self.scores(view)
        b, h, n = scores.shape
        protected = torch.zeros(n, dtype=torch.bool, device=scores.device)
        protected[: self.sink_size] = True
        protected[n - self.window:] = True
        n_protected = int(protected.sum())
        random_keep = min(self.random_budget, n_keep - n_protected)
        top_keep = n_keep - n_protected - random_keep
        candidates = scores.masked_fill(protected, float("-inf"))
        top = candidates.topk(top_keep, dim=-1).indices  # [B, H, top_keep]
        keep = protected.expand(b, h, n).clone()
        keep.scatter_(-1, top, True)
        if random_keep > 0:
            keep |= self.random_draw(scores, keep, random_keep, view.layer_idx)
        return keep.nonzero()[:, 2].view(b, h, n_keep)  # ascending per head

    def random_draw(self, scores: Tensor, taken: Tensor, count: int, layer_idx: int) -> Tensor:
        """NACL's random eviction: `count` more entries per head, drawn without replacement among those not `taken`,
        weighted by softmax(score / random_temperature); a `[B, H, n]` mask."""
        drawn = torch.zeros_like(taken)
        for row in range(scores.shape[0]):
            generator = torch.Generator(device=scores.device).manual_seed(self.seed + layer_idx)
            for head in range(scores.shape[1]):
                left = (~taken[row, head]).nonzero()[:, 0]
                if self.random_temperature <= 0:
                    weights = torch.ones(left.numel(), device=scores.device)
                else:
                    weights = (scores[row, head, left].float() / self.random_temperature).softmax(dim=0)
                picked = torch.multinomial(weights, count, replacement=False, generator=generator)
                drawn[row, head, left[picked]] = True
        return drawn
