"""CaM, Cache Merging (Zhang et al., ICML 2024): a start + recent window whose leaving entries are merged, not lost.
Reference code: zyxxmu/cam @ df5e076 (`cam_hf/utils_hh/modify_llama_cam.py: local_cam_mask`, `LlamaAttention_cam`).

The cache keeps `n_sink` start entries and the most recent rest (StreamingLLM's window; the authors' start_ratio =
recent_ratio: half the budget each by default). After every decode step's attention the layer holds budget + 1:
- the oldest recent entry goes (the one merged at the step before);
- the next oldest, which goes at the next step, is merged: with probability min(1, A_i / mean(A over the newer
  entries, the step's own token included)), A the step's attention (mean over each KV group's query heads), its
  value / `merge_budget` is added to the values of the `merge_budget` entries after it (those that exist: the
  authors' slice, still divided by `merge_budget`). One Bernoulli draw per KV head from the sample's seeded stream.
The prompt is cut to the window once after the prefill, without merging (the authors mask it at once), and so is a
chunk fed on top of the cache (a `query=agnostic` question, a later turn: the reference feeds none). As the
reference, the merge writes values the next steps read; the step itself attended the values as they were.

Differences from the reference: GQA (one draw per KV head, the group's mean attention: kvpress `CAMPress`'s
reduction); entries really freed (the reference masks them).
kvpress's `CAMPress(base_press)` is a different algorithm: every `compression_interval` steps it scores the cache with
a base press, evicts to `target_size` and merges the k best-scored evicted entries into their next `merge_budget`
kept entries, dividing by the targets that exist. Not implemented as a switch (docs/methods.md, its row).
Not in the static step (`step=static` refuses it in one line): its rule writes values, which the static rows do not.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from kvbench.methods.decoding import DecodingMethod, EvictionState
from kvbench.registry import METHODS


@METHODS.register("cam")
@dataclass
class CaM(DecodingMethod):
    writes_values: ClassVar[bool] = True  # (MLA: refused)
    n_sink: int | None = None  # start entries kept; None: half the budget (the authors' start_ratio = recent_ratio)
    merge_budget: int = 32  # entries after a leaving one that share its value (the authors' constant)

    accumulates_attention: ClassVar[bool] = False  # the prompt is cut by position: no prefill column sums
    keeps_history: ClassVar[bool] = False  # a step's attention row is the score (the merge reads only it)
    merges_values: ClassVar[bool] = True  # writes values while decoding (refused by the static step)

    def __post_init__(self):
        if self.n_sink is not None and self.n_sink < 0:
            raise ValueError(f"cam: n_sink={self.n_sink} must be >= 0, or null for half the budget")
        if self.merge_budget < 1:
            raise ValueError(f"cam: merge_budget={self.merge_budget} must be >= 1")

    def starts(self, budget: int) -> int:
        return budget // 2 if self.n_sink is None else self.n_sink

    def check_budget(self, budget: int | None) -> None:
        super().check_budget(budget)
        if budget - self.starts(budget) < 2:
            raise ValueError(f"cam: budget={budget} must leave at least 2 recent entries after n_sink="
                             f"{self.starts(budget)} (one leaves, the next is merged); raise budget or lower "
                             "method.n_sink.")

    def evict(self, state: EvictionState, layer_idx: int, scores: Tensor, prefill: bool) -> Tensor | None:
        b, h, n = scores.shape
        if n <= state.budget:
            return None
        start = self.starts(state.budget)
        recent = state.budget - start
        if not prefill and n == state.budget + 1:
            self.merge(state.layers[layer_idx].values, scores, start + 1, state.generator_on(scores.device))
        dev = scores.device
        idx = torch.cat([torch.arange(start, device=dev), torch.arange(n - recent, n, device=dev)])
        return idx.expand(b, h, state.budget)

    def merge(self, values: Tensor, attention: Tensor, i: int, generator: torch.Generator) -> None:
        """Add entry i's value / merge_budget to the next `merge_budget` entries' values, per KV head with
        probability min(1, A_i / mean A_{i+1..}) (`values` `[B, H, n, D]` in place; `attention` `[B, H, n]`)."""
        prob = attention[..., i] / attention[..., i + 1:].mean(dim=-1)
        prob = torch.nan_to_num(prob, nan=0.0, posinf=1.0).clamp(0, 1)
        merged = torch.bernoulli(prob, generator=generator)  # [B, H]
        share = values[:, :, i:i + 1].float() * (merged / self.merge_budget)[..., None, None]
        targets = values[:, :, i + 1:i + 1 + self.merge_budget]
        targets.add_(share.to(values.dtype))
