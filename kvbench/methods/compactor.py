"""Compactor (Chari & Van Durme, arXiv 2507.08143, "Compactor: Calibrated Query-Agnostic KV Cache Compression with
Approximate Leverage Scores"). Reference: NVIDIA/kvpress 0.5.5 `CompactorPress`, whose reading is the default.

An entry's score blends its two question-agnostic scores, each z-scored over the layer (one mean and one std over
every KV head and entry): `blending` x the sketched leverage of its pre-RoPE key (`leverage_score`) + the chunked
non-causal attention its key receives, times its value's norm and average-pooled (`non_causal_attn`). Both are
computed on the middle of the prompt only: the first `sink_size_start` and last `sink_size_end` entries are cut off
first (the leverage's centring, the chunks and the pooling see the middle alone) and always kept. `blending` null =
kvpress's default, the compression ratio 1 - budget / n (a per-prompt weight: the harder the compression, the more
the leverage counts). The top `budget` per KV head are kept.

`variant=authors` is the authors' vLLM code (vnchari/compactor-vllm @ 48d9f65, `compression/compactor.py`), with
their settings given as fields: `variant=authors sink_size_start=16 sink_size_end=64 chunk_size=128 blending=0.5`
(`SequenceCompressionParams`' 16 / 64 protected tokens; `CompactorCompression.chunk_size`, `accum_blending`). The
whole prompt is scored, then the ends are protected; leverage per chunk of `leverage_chunk` = 512 pre-RoPE keys
(the last, shorter chunk on its own), each chunk centred, x (G + 5e-3 I)^-1 x^T with G its sketched Gram matrix
(their SVD), one Gaussian sketch `[D, k]` for every head; non-causal attention over chunks of `chunk_size` with raw
q.k, the padding masked, summed over the queries and the group's query heads, no value norm and no pooling, and
their kernel's quirk kept: each query row of the last 64-row tile past a chunk's end adds 1 / chunk_size to every
key of that chunk; each score z-scored over the layer with the population variance; attention + `blending` x
leverage. Their benchmarks also protect the question at the end (the eval scripts add its length to the protected
last tokens): not done here. That reading is not the default because its 80 protected tokens exceed small budgets.
Deviations from kvpress: the sketch is seeded per layer (`seed + layer`, as `leverage_score`); the protected ends
score +inf (kvpress: the layer's maximum, which keeps the same set unless a middle entry ties it exactly); the
z-score runs per batch row (kvpress: over the whole batch). Prefill only, as kvpress.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from kvbench.methods.base import LayerView, Method, reduce_groups
from kvbench.methods.leverage_score import LeverageScore, leverage_scores, prerope_keys
from kvbench.methods.non_causal_attn import EVERY_QUERY, NonCausalAttn, chunked_column_sums

TILE = 64  # the authors' kernel's query rows per tile (BLOCK_M)
from kvbench.registry import METHODS


def zscore(scores: Tensor, unbiased: bool = True) -> Tensor:
    """`[B, H, T]` standardised per batch row over all heads and entries (kvpress: std with Bessel's correction,
    clamped at 1e-6; the authors' kernel: the population std)."""
    flat = scores.flatten(1)
    mean = flat.mean(dim=1)
    std = flat.std(dim=1).clamp_min(1e-6) if unbiased else flat.var(dim=1, unbiased=False).sqrt()
    return (scores - mean[:, None, None]) / std[:, None, None]


def chunked_leverage(keys: Tensor, sketch: Tensor, chunk: int, regulariser: float = 5e-3) -> Tensor:
    """The authors' leverage `[B, H, n]`: keys `[B, H, n, D]` x sketch `[D, k]`, per chunk of `chunk` rows (the last
    one shorter), centred, x (XᵀX + regulariser I)^-1 xᵀ."""
    x = keys.float() @ sketch
    out = []
    for start in range(0, x.shape[-2], chunk):
        part = x[..., start:start + chunk, :]
        part = part - part.mean(dim=-2, keepdim=True)
        gram = part.transpose(-1, -2) @ part + regulariser * torch.eye(x.shape[-1], device=x.device)
        out.append((part * torch.linalg.solve(gram, part.transpose(-1, -2)).transpose(-1, -2)).sum(-1).clamp_min(0))
    return torch.cat(out, dim=-1)


def tile_padding(n: int, chunk: int, group: int) -> Tensor:
    """`[n]`: what the authors' kernel adds to each key, 1 / chunk per query row of its chunk's last 64-row tile
    past the chunk's end, for each of the group's query heads."""
    extra = torch.zeros(n)
    for start in range(0, n, chunk):
        rows = min(chunk, n - start)
        extra[start:start + rows] = group * (math.ceil(rows / TILE) * TILE - rows) / chunk
    return extra


@METHODS.register("compactor")
@dataclass
class Compactor(Method):
    prefill_needs: ClassVar[str | None] = "every prompt query"  # (its non-causal attention)
    sink_size_start: int = 8  # first entries always kept, left out of the scoring
    sink_size_end: int = 4  # last entries always kept, left out of the scoring
    chunk_size: int = 256  # non-causal attention chunk (kvpress default)
    sketch_dimension: int = 48  # leverage sketch width (kvpress default)
    blending: float | None = None  # weight of the leverage scores; null: the compression ratio 1 - budget / n
    seed: int = 0  # the sketch's seed (layer i draws from seed + i)
    mask_padding: bool = False  # non_causal_attn's switch: mask the last chunk's padding for real
    variant: Literal["kvpress", "authors"] = "kvpress"  # authors: their vLLM code's blend (module docstring)
    leverage_chunk: int = 512  # authors: keys per leverage chunk

    def __post_init__(self):
        for field in ("sink_size_start", "sink_size_end"):
            if getattr(self, field) < 0:
                raise ValueError(f"compactor: {field}={getattr(self, field)} must be >= 0")
        if self.variant not in ("kvpress", "authors"):
            raise ValueError(f"compactor: variant={self.variant!r} is not one of kvpress, authors")
        if self.leverage_chunk < 1:
            raise ValueError(f"compactor: leverage_chunk={self.leverage_chunk} must be >= 1")
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
        """`[B, H_kv, n]`: the blended z-scores of the middle (kvpress) or of the whole prompt (authors); the
        protected ends +inf."""
        n = view.prompt_len
        start = min(self.sink_size_start, n)
        end = n - min(self.sink_size_end, n - start)
        if self.variant == "authors":
            return self.authors_scores(view, n_keep).index_fill(-1, torch.tensor(
                [*range(start), *range(end, n)], dtype=torch.long, device=view.keys.device), float("inf"))
        middle = replace(view, keys=view.keys[:, :, start:end], values=view.values[:, :, start:end],
                         window_queries=None if view.window_queries is None else view.window_queries[:, :, -n:][
                             :, :, start:end])
        lever = zscore(leverage_scores(prerope_keys(view)[:, :, start:end], self.leverage.sketch(view)))
        attn = zscore(self.attention.scores(middle))
        blending = 1 - n_keep / n if self.blending is None else self.blending
        return F.pad(blending * lever + attn, (start, n - end), value=float("inf"))

    def authors_scores(self, view: LayerView, n_keep: int) -> Tensor:
        """`[B, H_kv, n]`: attention z-score + blending x leverage z-score over the whole prompt (the authors')."""
        n, h_kv = view.prompt_len, view.keys.shape[1]
        sketch = self.leverage.sketch(view)[0, 0]  # one `[D, k]` for every head
        lever = zscore(chunked_leverage(prerope_keys(view), sketch, self.leverage_chunk), unbiased=False)
        if view.window_queries is None or view.window_queries.shape[2] < n:
            raise ValueError(f"compactor: scoring needs every prompt query ({n}); it runs at prefill only")
        sums = chunked_column_sums(view.window_queries[:, :, -n:], view.keys, self.chunk_size, mask_padding=True)
        group = sums.shape[1] // h_kv
        attn = reduce_groups(sums, h_kv, "sum") + tile_padding(n, self.chunk_size, group).to(sums.device)
        blending = 0.5 if self.blending is None else self.blending
        return zscore(attn, unbiased=False) + blending * lever

    def select(self, view: LayerView, n_keep: int) -> Tensor:
        return self.scores(view, n_keep).topk(n_keep, dim=-1).indices.sort(dim=-1).values
