"""Compactor (Chari & Van Durme, arXiv 2507.08143, "Compactor: Calibrated Query-Agnostic KV Cache Compression with
Approximate Leverage Scores"). Reference: NVIDIA/kvpress 0.5.5 `CompactorPress`, whose reading is the default.

An entry's score blends its two question-agnostic scores, each z-scored over the layer (one mean and one std over
every KV head and entry): `blending` x the sketched leverage of its pre-RoPE key (`leverage_score`) + the chunked
non-causal attention its key receives, times its value's norm and average-pooled (`non_causal_attn`). Both are
computed on the middle of the prompt only: the first `sink_size_start` and last `sink_size_end` entries are cut off
first (the leverage's centring, the chunks and the pooling see the middle alone) and always kept. `blending` null =
kvpress's default, the compression ratio 1 - budget / n (a per-prompt weight: the harder the compression, the more
the leverage counts). The top `budget` per KV head are kept.

The authors' code (vnchari/compactor-vllm @ a6f878b, `compression/compactor.py`) differs from kvpress's: leverage per
chunk of 512 keys (an SVD of Gram + 5e-3 I), non-causal attention over chunks of 128 without the value norm and the
pooling, a fixed blending of 0.5 (leverage and attention each z-scored); that reading is not implemented here.
Deviations from kvpress: the sketch is seeded per layer (`seed + layer`, as `leverage_score`); the protected ends
score +inf (kvpress: the layer's maximum, which keeps the same set unless a middle entry ties it exactly); the
z-score runs per batch row (kvpress: over the whole batch). Prefill only, as kvpress.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from kvbench.methods.base import LayerView, Method
from kvbench.methods.leverage_score import LeverageScore, leverage_scores, prerope_keys
from kvbench.methods.non_causal_attn import EVERY_QUERY, NonCausalAttn
from kvbench.registry import METHODS


def zscore(scores: Tensor) -> Tensor:
    """`[B, H, T]` standardised per batch row over all heads and entries (kvpress: std with Bessel's correction)."""
    flat = scores.flatten(1)
    mean, std = flat.mean(dim=1), flat.std(dim=1).clamp_min(1e-6)
    return (scores - mean[:, None, None]) / std[:, None, None]


@METHODS.register("compactor")
@dataclass
class Compactor(Method):
    sink_size_start: int = 8  # first entries always kept, left out of the scoring
    sink_size_end: int = 4  # last entries always kept, left out of the scoring
    chunk_size: int = 256  # non-causal attention chunk (kvpress default)
    sketch_dimension: int = 48  # leverage sketch width (kvpress default)
    blending: float | None = None  # weight of the leverage scores; null: the compression ratio 1 - budget / n
    seed: int = 0  # the sketch's seed (layer i draws from seed + i)
    mask_padding: bool = False  # non_causal_attn's switch: mask the last chunk's padding for real

    def __post_init__(self):
        for field in ("sink_size_start", "sink_size_end"):
            if getattr(self, field) < 0:
                raise ValueError(f"compactor: {field}={getattr(self, field)} must be >= 0")
        if self.blending is not None and self.blending < 0:
            raise ValueError(f"compactor: blending={self.blending} must be >= 0 (or null: the compression ratio)")
        self.leverage = LeverageScore(self.sketch_dimension, self.seed)  # (their own checks: one line each)
        self.attention = NonCausalAttn(self.chunk_size, self.mask_padding)

    @property
    def query_window(self) -> int:
        return EVERY_QUERY  # the non-causal attention needs every prompt query

    @property
    def kept_window(self) -> int:
        return self.sink_size_end

    def check_budget(self, budget: int | None) -> None:
        super().check_budget(budget)
        if budget <= self.sink_size_start + self.sink_size_end:
            raise ValueError(f"compactor: sink_size_start + sink_size_end = {self.sink_size_start + self.sink_size_end}"
                             f" must be < budget={budget} (the protected ends count inside the budget); lower them "
                             "or raise budget.")

    def scores(self, view: LayerView, n_keep: int) -> Tensor:
        """`[B, H_kv, n]`: the blended z-scores of the middle; the protected ends +inf."""
        n = view.prompt_len
        start = min(self.sink_size_start, n)
        end = n - min(self.sink_size_end, n - start)
        middle = replace(view, keys=view.keys[:, :, start:end], values=view.values[:, :, start:end],
                         window_queries=None if view.window_queries is None else view.window_queries[:, :, -n:][
                             :, :, start:end])
        lever = zscore(leverage_scores(prerope_keys(view)[:, :, start:end], self.leverage.sketch(view)))
        attn = zscore(self.attention.scores(middle))
        blending = 1 - n_keep / n if self.blending is None else self.blending
        return F.pad(blending * lever + attn, (start, n - end), value=float("inf"))

    def select(self, view: LayerView, n_keep: int) -> Tensor:
        return self.scores(view, n_keep).topk(n_keep, dim=-1).indices.sort(dim=-1).values
