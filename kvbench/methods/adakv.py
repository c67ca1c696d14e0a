"""Ada-KV (Feng et al., arXiv 2407.11550): adaptive per-head budgets. Reference code: FFY0/AdaKV
(`AdaptiveSnapKVCluster`, adaptive_snapkv/monkeypatch/snapkv_utils.py), scoring as SnapKV (window 32, max-pool 7).

Within a layer, the heads compete for the layer's budget: a global top-(H * B') over all heads' pooled window scores
gives each head a count f_i, and a safeguard keeps at least alpha * B' per head:
    B_i = round((1 - alpha) * f_i + int(alpha * B'))      (B' = budget - window; torch.round, half to even)
Head i then keeps its own top-B_i prompt entries plus the window. The cache stores the heads' different lengths for
real (`kvbench.cache.varlen`), so memory and decode time follow the kept entries, unlike kvpress's masking.

Defaults and switches:
- `granularity="kv_head"` (the official code's `gqa_support`, scores reduced over each group by `gqa_reduce`) with
  `alpha=0.2`, the official GQA setting; `granularity="query_head"` + `alpha=0.5` is paper v2 (KV repeated per query
  head, H_q heads stored), for rebuilding its tables.
- `allocation="kvpress"` is kvpress's AdaKVPress rule instead: each head's top int(alpha * n_keep) entries (window
  first, as its padded window scores win) are protected, then the layer's H * n_keep entries are a global top-k.
  With `window=64 kernel=5 pooling=avg` the kept entries equal `AdaKVPress(SnapKVPress())`'s unmasked ones
  (tests/unit/test_kvpress_oracle.py).
- Budgets are computed per sample (the official code froze Ada-Pyramid's layer budgets from the first sample).
- Ada-Pyramid's layer budgets follow the official `AdaptiveSnapKVCluster` (`ada_pyramid_budgets`): PyramidKV's
  integer schedule *without* its uniform regime for B <= n < 2(B - w): the bottom layer is clamped to n - w and the
  pyramid kept (n=1500, B=1024, w=32: layers 1500 -> 570 entries, mean 1035). A layer keeps everything only when
  its own selected budget exceeds n - w. `exact=True` gives PyramidKV's budget-matched schedule instead.
- No compression when the prompt is not longer than the budget.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import Tensor

from kvbench.methods.base import LayerView
from kvbench.methods.pyramidkv import ada_pyramid_budgets, pyramid_budgets
from kvbench.methods.snapkv import WindowScorer
from kvbench.registry import METHODS


def ada_head_budgets(scores: Tensor, n_select: int, alpha: float) -> Tensor:
    """Official allocation: per-head counts `[H]` of selected (non-window) entries from scores `[H, L]`."""
    n_heads, length = scores.shape
    top = scores.flatten().topk(n_heads * n_select).indices
    counts = torch.bincount(top // length, minlength=n_heads).float()
    return torch.round(counts * (1 - alpha) + int(n_select * alpha)).long().clamp(max=length)


def ada_select_official(scores: Tensor, n_keep: int, window: int, alpha: float) -> list[Tensor]:
    """Per head: its top-B_i prefix positions (B_i from `ada_head_budgets`) plus the window, sorted."""
    n = scores.shape[-1] + window
    recent = torch.arange(n - window, n, device=scores.device)
    budgets = ada_head_budgets(scores, n_keep - window, alpha)
    return [torch.cat([s.topk(int(b)).indices, recent]).sort().values for s, b in zip(scores, budgets)]


def ada_select_kvpress(scores: Tensor, n_keep: int, window: int, alpha: float) -> list[Tensor]:
    """kvpress AdaKVPress: window scores padded above every prefix score, each head's top max(1, int(alpha *
    n_keep)) protected, then a global top-(H * n_keep) over the layer."""
    n_heads = scores.shape[0]
    padded = torch.cat([scores, scores.new_full((n_heads, window), scores.max().item() + 1)], dim=-1)
    n_safe = max(1, int(n_keep * alpha))
    protected = padded.scatter(-1, padded.topk(n_safe, dim=-1).indices, float("inf"))
    top = protected.flatten().topk(n_heads * n_keep).indices
    n = padded.shape[-1]
    return [(top[top // n == h] % n).sort().values for h in range(n_heads)]


@METHODS.register("adakv")
@dataclass
class AdaKV(WindowScorer):
    """Ada-SnapKV: SnapKV's scores, uniform layer budgets, adaptive per-head split."""

    own_storage: ClassVar[bool] = True  # per-head variable layers

    alpha: float = 0.2  # safeguard: share of each head's budget it keeps whatever the competition
    allocation: Literal["official", "kvpress"] = "official"

    def __post_init__(self):
        super().__post_init__()
        name = type(self).registry_name
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"{name}: alpha={self.alpha} must be in [0, 1]")
        if self.allocation not in ("official", "kvpress"):
            raise ValueError(f"{name}: allocation={self.allocation!r} is not one of official, kvpress")

    def select(self, view: LayerView, n_keep: int) -> list[Tensor]:
        if view.keys.shape[0] != 1:
            raise ValueError(f"{type(self).registry_name}: per-head variable budgets need batch size 1")
        scores = self.scores(view)[0]  # [H, n - window]
        if self.allocation == "kvpress":
            return ada_select_kvpress(scores, n_keep, self.window, self.alpha)
        return ada_select_official(scores, n_keep, self.window, self.alpha)


@METHODS.register("ada_pyramidkv")
@dataclass
class AdaPyramidKV(AdaKV):
    """Ada-Pyramid: the official code's pyramid of layer budgets (`ada_pyramid_budgets`: integer step, beta 20,
    window 32, no uniform regime), then the adaptive per-head split inside each layer."""

    beta: int = 20
    exact: bool = False  # True: budget-matched layer schedule (see PyramidKV)

    def layer_budgets(self, prompt_len: int, n_layers: int, budget: int) -> list[int]:
        if self.exact:
            return pyramid_budgets(prompt_len, n_layers, budget, self.window, self.beta, exact=True)
        return ada_pyramid_budgets(prompt_len, n_layers, budget, self.window, self.beta)
