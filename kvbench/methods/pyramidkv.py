"""PyramidKV (Cai et al., arXiv 2406.02069). Reference code: Zefan-Cai/KVCache-Factory `PyramidKVCluster` @ ffac160.

SnapKV's selection with a per-layer budget that falls linearly from the bottom layer to the top one. `budget` B is
the per-layer average, window included. Defaults follow the reference scripts (window 8, max-pool 7, beta 20) and its
integer schedule (`pyramid_budgets`), with these quirks and switches:
- The step is floored, so the mean kept per layer exceeds B (e.g. 133.5 at B=128 on 32 layers, +4.3 %).
  `exact=True` distributes exactly L * (B - window) selected entries (floors of the exact linear values, the
  remainder given one each to the bottom layers). The effective budget is recorded either way.
- Regimes: no compression when n < B; uniform SnapKV when B <= n < 2(B - window); the pyramid otherwise.
- `schedule="adakv"`: the schedule of FFY0/AdaKV's code (its "Pyramid" rows): the same integer step, but the bottom
  layer is clamped to n - w and the pyramid kept where PyramidKV goes uniform (`ada_pyramid_budgets`).
- `schedule="kvpress"`: kvpress 0.5.5's `PyramidKVPress.get_layer_budget` (`kvpress_pyramid_budgets`): float
  bounds from c = B (kvpress: n (1 - r), equal when that is an integer), top layer c / beta, bottom 2c - top,
  clamped to n - w like the reference, each layer's total (window inside) rounded half to even, and uniform B
  whenever the bounds do not satisfy n >= bottom >= top >= w (always the case at kvpress's window 64 unless
  B >= 64 beta). kvpress's defaults are `window=64 kernel=5 pooling=avg`; with the same window, kernel and pooling
  the kept entries equal PyramidKVPress's (tests/unit/test_kvpress_oracle.py, at window 4 so the pyramid occurs).
- `granularity="query_head"` is the paper-era layout (KV repeated per query head before selection); see SnapKV.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvbench.methods.snapkv import WindowScorer
from kvbench.registry import METHODS


def pyramid_budgets(prompt_len: int, n_layers: int, budget: int, window: int, beta: int,
                    exact: bool = False) -> list[int]:
    """Entries kept per head in each layer (window included), bottom layer first, as `PyramidKVCluster.update_kv`."""
    n, c = prompt_len, budget - window
    if n < budget:
        return [n] * n_layers
    if n < 2 * c or n_layers == 1:
        return [budget] * n_layers
    k_min = c // beta
    k_max = 2 * c - k_min
    if k_max >= n - window:
        k_max = n - window
        k_min = 2 * c - k_max
    if not exact:
        step = (k_max - k_min) // (n_layers - 1)
        return [k_max - layer * step + window for layer in range(n_layers)]
    slope = (k_max - k_min) / (n_layers - 1)
    selected = [int(k_max - layer * slope) for layer in range(n_layers)]
    for layer in range(n_layers * c - sum(selected)):  # the remainder, one each, from the bottom layer up
        selected[layer % n_layers] += 1
    return [min(k, n - window) + window for k in selected]


def ada_pyramid_budgets(prompt_len: int, n_layers: int, budget: int, window: int, beta: int) -> list[int]:
    """Entries kept per head in each layer (window included), bottom first, as FFY0/AdaKV's `AdaptiveSnapKVCluster`
    (and its `SnapKVCluster`, the "Pyramid" rows of Ada-KV's tables) compute them: integer step, the clamp when the bottom layer would exceed n - w, and no regime
    switch. Values above the prompt length mean "keep the layer whole" (compress skips those layers)."""
    if n_layers == 1:  # the official step divides by n_layers - 1; one layer has nothing to spread
        return [budget]
    c = budget - window
    k_min = c // beta
    k_max = 2 * c - k_min
    if k_max >= prompt_len - window:
        k_max = prompt_len - window
        k_min = 2 * c - k_max
    step = (k_max - k_min) // (n_layers - 1)  # floor division, also when negative (n < B), as Python's ints do
    return [k_max - layer * step + window for layer in range(n_layers)]


def kvpress_pyramid_budgets(prompt_len: int, n_layers: int, budget: int, window: int, beta: int) -> list[int]:
    """Entries kept per head in each layer (window included), bottom layer first, as kvpress 0.5.5's
    `PyramidKVPress.get_layer_budget` computes them with n (1 - r) = `budget`: float bounds, Python's round."""
    n = prompt_len
    if n <= budget:
        return [n] * n_layers
    top = budget / beta
    bottom = 2 * budget - top
    if bottom >= n - window:
        bottom = n - window
        top = 2 * budget - bottom
    if not n >= bottom >= top >= window:
        return [budget] * n_layers
    step = (bottom - top) / (n_layers - 1) if n_layers > 1 else 0.0
    return [round(bottom - layer * step) for layer in range(n_layers)]


SCHEDULES = ("pyramidkv", "adakv", "kvpress")


@METHODS.register("pyramidkv")
@dataclass
class PyramidKV(WindowScorer):
    window: int = 8
    beta: int = 20  # top layer gets (B - window) / beta selected entries
    exact: bool = False  # True: budget-matched schedule (mean kept == B exactly)
    schedule: Literal["pyramidkv", "adakv", "kvpress"] = "pyramidkv"  # adakv: FFY0/AdaKV's (no uniform regime);
    #                                                                 kvpress: PyramidKVPress's float schedule

    def __post_init__(self):
        super().__post_init__()
        if self.beta < 1:
            raise ValueError(f"pyramidkv: beta={self.beta} must be >= 1")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"pyramidkv: schedule={self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if self.schedule == "kvpress" and self.exact:
            raise ValueError("pyramidkv: exact=true is a schedule of its own; use it with schedule=pyramidkv")

    def layer_budgets(self, prompt_len: int, n_layers: int, budget: int) -> list[int]:
        if self.schedule == "kvpress":
            return kvpress_pyramid_budgets(prompt_len, n_layers, budget, self.window, self.beta)
        if self.schedule == "adakv" and not self.exact:
            return ada_pyramid_budgets(prompt_len, n_layers, budget, self.window, self.beta)
        return pyramid_budgets(prompt_len, n_layers, budget, self.window, self.beta, self.exact)
