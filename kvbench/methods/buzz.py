"""BUZZ (Zhao, Fang et al., arXiv 2410.23079). Reference code: JunqiZhao888/buzz-llm @ e6f5e3e
(`BuzzKVCacheWithAccumulation`).

The cache is [sink | middle = old samples + new buffer | recent window]. Nothing happens until the middle exceeds
the threshold T; then the old samples are thinned by interval sampling (stride s_hat = (s + 1) // 2, first of each
group, same for every head) and the new buffer is cut into chunks of s tokens, each keeping its per-head argmax of
accumulated attention ("local heavy hitters", first maximum on ties). Scores are H2O-style accumulated attention.

Parameters: sink 4, stride 5. With `window`/`threshold` unset they follow the budget in "peak" mode (the spec's
recommended mapping): sink + window + T = budget and T / window = (s^2 + 1) / (s + 1) for odd s (s - 1 for even s),
Theorem 3.1's optimum, so the cache never holds more than `budget` entries after a step. Set both to rebuild the
paper's runs (code defaults: window 160, T 400).
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

    def __post_init__(self):
        if self.stride < 2 or self.n_sink < 0:
            raise ValueError(f"buzz: stride={self.stride} must be >= 2 and n_sink={self.n_sink} >= 0")
        if self.prefill_mode not in ("loop", "single_pass"):
            raise ValueError(f"buzz: prefill_mode={self.prefill_mode!r} is not one of loop, single_pass")

    @property
    def logit_scale(self):
        """n_keys -> factor on the model's attention logits, or None (the capture applies it to every layer)."""
        return logn_scale if self.logn else None

    def sizes(self, budget: int) -> tuple[int, int]:
        """(window, threshold) for a budget."""
        window = self.window
        if window is None:
            window = round((budget - self.n_sink) / (1 + theorem_ratio(self.stride)))
        threshold = self.threshold if self.threshold is not None else budget - self.n_sink - window
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
