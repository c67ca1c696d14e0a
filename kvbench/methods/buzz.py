"""BUZZ (Zhao, Fang et al., arXiv 2410.23079). Reference code: JunqiZhao888/buzz-llm @ e6f5e3e
(`BuzzKVCacheWithAccumulation`).

The cache is [sink | middle = old samples + new buffer | recent window]. Nothing happens until the middle exceeds
the threshold T; then the old samples are thinned by interval sampling (stride s_hat = (s + 1) // 2, first of each
group, same for every head) and the new buffer is cut into chunks of s tokens, each keeping its per-head argmax of
accumulated attention ("local heavy hitters", first maximum on ties). Scores are H2O-style accumulated attention.

Parameters: sink 4, stride 5. With `window`/`threshold` unset they follow the budget in "peak" mode (kvbench's
recommended mapping): sink + window + T = budget and T / window = (s^2 + 1) / (s + 1) for odd s (s - 1 for even s),
Theorem 3.1's optimum, so the cache never holds more than `budget` entries after a step. Set both to rebuild the
paper's runs (code defaults: window 160, T 400). `tw_ratio` replaces the theorem's T / w (Table A's ablation).
`budget_mode="average"` is the paper's reading of a budget (Sec. 4.2.1: "the percentage of the average cache
size"): the budget is the mean occupancy over an eviction cycle, sink + window + (a* + T) / 2 with the middle after
an eviction a* = T / theorem_ratio(stride) (Theorem 3.1's fixed point), so the cache peaks above `budget`.
`prefill_mode="loop"` (default) follows Remark 2: after prefill's local-max pass, the middle is interval-thinned
until it fits T; `single_pass` is the code, which leaves the thinning to the first decode steps.
`logn=True` is the paper's "BUZZ (with log n)" rows (Sec. 3.5; a commented-out line of the code): every layer's
and head's attention logits are multiplied by log_512 of the current key count (cache + new tokens; n for every
prefill row) before the mask and softmax, so BUZZ's accumulated scores change with them. Below 512 keys it flattens
attention (0.63 at 50 keys); at 512 it is the identity.
Positions: the official experiments re-rotate keys to their cache slots ("pos-shift") for every method; that is
the run-level `positions=shift` option, shared by all methods (default: original positions).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from kvbench.methods.decoding import DecodingMethod, EvictionState
from kvbench.registry import METHODS


def theorem_ratio(stride: int) -> float:
    """T / w at the post-eviction fixed point a* = w (Theorem 3.1)."""
    return (stride**2 + 1) / (stride + 1) if stride % 2 else stride - 1


def logn_scale(n_keys: int) -> float:
    """log_512(n_keys): 1 at the pre-training length 512 that the paper normalises to, 0 for a single key."""
    return math.log(n_keys) / math.log(512)


def buzz_keep(scores: Tensor, n_sink: int, window: int, m_old: int, stride: int) -> tuple[Tensor, int]:
    """One eviction (code semantics) over scores `[B, H, n]`: returns the sorted kept indices and the new
    old-sample count."""
    b, h, n = scores.shape
    dev = scores.device
    old = torch.arange(n_sink, n_sink + m_old, (stride + 1) // 2, device=dev)
    lo, hi = n_sink + m_old, n - window
    n_chunks = math.ceil((hi - lo) / stride)
    padded = torch.full((b, h, n_chunks * stride), float("-inf"), device=dev)
    padded[..., : hi - lo] = scores[..., lo:hi]
    new = padded.view(b, h, n_chunks, stride).argmax(dim=-1) + lo + torch.arange(n_chunks, device=dev) * stride
    fixed = lambda idx: idx.expand(b, h, len(idx))  # noqa: E731  (same positions for every head)
    idx = torch.cat([fixed(torch.arange(n_sink, device=dev)), fixed(old), new,
                     fixed(torch.arange(hi, n, device=dev))], dim=-1)
    return idx, len(old) + n_chunks


@METHODS.register("buzz")
@dataclass
class BUZZ(DecodingMethod):
    n_sink: int = 4
    stride: int = 5  # s: one token survives per chunk of s new tokens
    window: int | None = None  # recent window w; None = from the budget (Theorem 3.1)
    threshold: int | None = None  # T, the middle's capacity; None = budget - n_sink - window
    prefill_mode: Literal["loop", "single_pass"] = "loop"
    logn: bool = False  # attention temperature log_512(n_keys) on every layer (the "with log n" rows)
    tw_ratio: float | None = None  # T / w for a budget; None = Theorem 3.1's optimum for the stride
    budget_mode: Literal["peak", "average"] = "peak"  # what `budget` caps: the cache after a step, or its mean

    def __post_init__(self):
        if self.stride < 2 or self.n_sink < 0:
            raise ValueError(f"buzz: stride={self.stride} must be >= 2 and n_sink={self.n_sink} >= 0")
        if self.prefill_mode not in ("loop", "single_pass"):
            raise ValueError(f"buzz: prefill_mode={self.prefill_mode!r} is not one of loop, single_pass")
        if self.budget_mode not in ("peak", "average"):
            raise ValueError(f"buzz: budget_mode={self.budget_mode!r} is not one of peak, average")
        if self.tw_ratio is not None and self.tw_ratio <= 0:
            raise ValueError(f"buzz: tw_ratio={self.tw_ratio} must be > 0")

    @property
    def logit_scale(self):
        """n_keys -> factor on the model's attention logits, or None (the capture applies it to every layer)."""
        return logn_scale if self.logn else None

    def sizes(self, budget: int) -> tuple[int, int]:
        """(window, threshold) for a budget: peak k + w + T = budget; average k + w + (a* + T) / 2 = budget."""
        ratio = self.tw_ratio if self.tw_ratio is not None else theorem_ratio(self.stride)
        # T per unit of budget beyond the window: 1 at peak; (1 + a*/T) / 2 on average
        share = 1.0 if self.budget_mode == "peak" else (1 + 1 / theorem_ratio(self.stride)) / 2
        window = self.window
        if window is None:
            window = round((budget - self.n_sink) / (1 + ratio * share))
        threshold = self.threshold
        if threshold is None:
            threshold = budget - self.n_sink - window if self.budget_mode == "peak" else round(ratio * window)
        return window, threshold

    def check_budget(self, budget: int | None) -> None:
        super().check_budget(budget)
        window, threshold = self.sizes(budget)
        if window < 1 or threshold < 1:
            raise ValueError(f"buzz: budget={budget} leaves window={window}, threshold={threshold} after "
                             f"{self.n_sink} sinks; raise budget (>= {self.n_sink + 2 + self.stride}).")

    def evict(self, state: EvictionState, layer_idx: int, scores: Tensor, prefill: bool) -> Tensor | None:
        window, threshold = self.sizes(state.budget)
        if scores.shape[-1] - self.n_sink - window <= threshold:
            return None
        m_old = state.extra[layer_idx].get("m_old", 0)
        idx, m_old = buzz_keep(scores, self.n_sink, window, m_old, self.stride)
        if prefill and self.prefill_mode == "loop":  # Remark 2: thin the middle until it fits
            s_hat = (self.stride + 1) // 2
            while m_old > threshold:
                middle = idx[..., self.n_sink: self.n_sink + m_old: s_hat]
                idx = torch.cat([idx[..., : self.n_sink], middle, idx[..., self.n_sink + m_old:]], dim=-1)
                m_old = middle.shape[-1]
        state.extra[layer_idx]["m_old"] = m_old
        return idx
