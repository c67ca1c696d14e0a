"""CriticalKV and CriticalAdaKV (Feng et al., arXiv 2502.03805, "Identify Critical KV Cache in LLM Inference from an
Output Perturbation Perspective"). Reference: NVIDIA/kvpress 0.5.5 `CriticalKVPress` and `CriticalAdaKVPress`
(contributed by the authors; their repository FFY0/AdaKV was not read for this method here).

Two stages on top of a scorer's scores s (here kvpress's SnapKV scores, as its leaderboard runs them: window 64,
average pool 5, group mean, the window at the layer's maximum + 1: `kvbench.methods.chunkkv.kvpress_snapkv_scores`):
1. the top int(`first_stage_ratio` x budget) entries by s are kept outright;
2. the rest of the budget goes to the top entries by (s + `epsilon`) x ‖V W_o‖₁, the L1 norm of what each value adds
   to the attention output through the output projection (per query head, averaged over each KV group).
`critical_adakv` splits each layer's budget across its KV heads first, as Ada-KV with kvpress's rule: each head's
top max(1, int(`alpha` x budget)) entries by s are protected, a top-(H x budget) over the layer's heads gives each
head its count b_h, and both stages then run per head with int(b_h x `first_stage_ratio`) and b_h. Heads then hold
different lengths for real (kvbench.cache.varlen; kvpress masks instead), batch 1.

W_o comes from the view (`LayerView.output_weight`, read from the model's attention by the family adapter); the norm
is built one query head at a time (n x hidden), as kvpress. Prefill only: under `decode_compression` the view has no
output projection and it stops in one line. `window`, `kernel`, `pooling` set the SnapKV scorer (32, 7, max: the
SnapKV reference's; kvbench's own `snapkv` also sums rather than averages the window rows, which ranks alike).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from kvbench.methods.base import LayerView
from kvbench.methods.chunkkv import KvpressWindowScorer
from kvbench.registry import METHODS


def output_l1_norms(values: Tensor, weight: Tensor) -> Tensor:
    """Values `[B, H_kv, n, D]`, W_o `[hidden, H_q * D]` -> `[B, H_kv, n]`: ‖v W_o,h‖₁ averaged over each group."""
    b, h_kv, n, d = values.shape
    h_q = weight.shape[1] // d
    norms = torch.stack([(values[:, h * h_kv // h_q].float() @ weight[:, h * d:(h + 1) * d].float().T).abs().sum(-1)
                         for h in range(h_q)], dim=1)  # one query head at a time: [B, n, hidden] held, not H_q of it
    return norms.view(b, h_kv, h_q // h_kv, n).mean(dim=2)


@METHODS.register("critical_kv")
@dataclass
class CriticalKV(KvpressWindowScorer):
    reads_per_head: ClassVar[frozenset[str]] = frozenset({"output projection W_o"})  # (MLA: refused)
    prefill_needs: ClassVar[str | None] = "the layer's output projection W_o"  # (for its value weights)
    epsilon: float = 1e-4  # added to the first scores before weighing by the output norm
    first_stage_ratio: float = 0.5  # share of the budget kept by the first scores alone

    def __post_init__(self):
        super().__post_init__()
        name = type(self).registry_name
        if not 0 <= self.first_stage_ratio <= 1:
            raise ValueError(f"{name}: first_stage_ratio={self.first_stage_ratio} must be in [0, 1]")
        if self.epsilon < 0:
            raise ValueError(f"{name}: epsilon={self.epsilon} must be >= 0")

    def first_scores(self, view: LayerView) -> Tensor:
        return self.snapkv_scores(view)

    def output_norms(self, view: LayerView) -> Tensor:
        if view.output_weight is None:
            raise ValueError(f"{self.registry_name}: the view has no output projection (W_o); it scores at prefill "
                             "only (not under decode_compression)")
        return output_l1_norms(view.values, view.output_weight)

    def first_count(self, n_keep: int) -> int:
        count = int(n_keep * self.first_stage_ratio)
        return max(1, count) if self.first_stage_ratio > 0 else 0  # kvpress: never 0 unless the ratio is

    def select(self, view: LayerView, n_keep: int) -> Tensor:
        scores = self.first_scores(view)
        first = scores.topk(self.first_count(n_keep), dim=-1).indices
        second = (scores + self.epsilon) * self.output_norms(view)
        second.scatter_(-1, first, torch.finfo(second.dtype).max)  # stage 1 wins
        return second.topk(n_keep, dim=-1).indices.sort(dim=-1).values


@METHODS.register("critical_adakv")
@dataclass
class CriticalAdaKV(CriticalKV):
    own_storage: ClassVar[bool] = True  # per-head variable layers
    alpha: float = 0.2  # Ada-KV's safeguard: share of the budget each head keeps whatever the competition

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"critical_adakv: alpha={self.alpha} must be in [0, 1]")

    def select(self, view: LayerView, n_keep: int) -> list[Tensor]:
        if view.keys.shape[0] != 1:
            raise ValueError("critical_adakv: per-head variable budgets need batch size 1")
        scores = self.first_scores(view)[0]  # [H, n]
        n_heads, n = scores.shape
        top = torch.finfo(scores.dtype).max
        n_safe = max(1, int(n_keep * self.alpha)) if self.alpha > 0 else 0
        scores = scores.scatter(-1, scores.topk(n_safe, dim=-1).indices, top)  # each head's safeguard
        chosen = scores.flatten().topk(n_heads * n_keep).indices
        budgets = torch.bincount(chosen // n, minlength=n_heads).tolist()  # b_h, summing to H x n_keep
        second = (scores + self.epsilon) * self.output_norms(view)[0]
        kept = []
        for h, b in enumerate(budgets):
            first = scores[h].topk(int(b * self.first_stage_ratio)).indices
            row = second[h].scatter(-1, first, top)
            kept.append(row.topk(b).indices.sort().values)
        return kept
