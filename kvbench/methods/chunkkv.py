"""ChunkKV (Liu et al., arXiv 2502.00299, "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient
Long-Context LLM Inference"). Reference: NVIDIA/kvpress 0.5.5 `ChunkKVPress(SnapKVPress())` and
`EntropyGatedChunkKVPress` (the authors' repository was not read here; their layer-wise index reuse is not
implemented).

Tokens are kept or dropped by chunks of `chunk_length` consecutive entries, the same chunks in every KV head of a
layer. Token scores are kvpress's SnapKV scores: the mean attention the last `window` prompt queries pay each prefix
entry (softmax in fp32, causal inside the window), pooled along the sequence (`pooling`, `kernel`: kvpress's average
pool of 5) and averaged over each KV group; the window's own entries score the layer's maximum + 1. A chunk's score is
the mean over its tokens of the token scores summed over KV heads (a trailing partial chunk is a chunk too). Chunks
are taken by decreasing score while they fit in `budget`; the next one gives its best tokens to fill the budget
exactly (kvbench keeps exactly `budget` entries per head; kvpress keeps int(chunks x (1 - ratio)) whole chunks, the
same set when the budget is a multiple of `chunk_length`).

`entropy_gate=true` is kvpress's `EntropyGatedChunkKVPress`: a chunk at or above the median chunk score whose token
scores have a normalised entropy below the median (important but spiky) keeps only its `low_entropy_chunk_length`
best tokens, and the budget left at the end goes to the best remaining tokens (kvpress's default chunk length for it
is 10: set `method.chunk_length=10`). kvpress picks chunks from batch row 0 for the whole batch; kvbench per row.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from kvbench.methods.base import LayerView, Method, pool1d, reduce_groups, window_attention
from kvbench.registry import METHODS

EPSILON = 1e-8  # kvpress's, inside the entropy


def kvpress_snapkv_scores(view: LayerView, window: int, kernel: int, pooling: str) -> Tensor:
    """`[B, H_kv, n]`: kvpress SnapKVPress's scores (window-mean attention, pooled per query head, averaged over each
    KV group; the window's own entries at each batch row's maximum + 1). Shared with CriticalKV."""
    n = view.prompt_len
    attn = window_attention(view.window_queries[:, :, -window:], view.keys, view.scaling, view.window_bias,
                            view.softcap, view.sinks)
    prefix = pool1d(attn[..., : n - window].mean(dim=2), kernel, pooling)  # [B, H_q, n - w]
    prefix = reduce_groups(prefix, view.keys.shape[1], "mean")
    top = prefix.amax(dim=(1, 2), keepdim=True) + 1
    return torch.cat([prefix, top.expand(-1, prefix.shape[1], window)], dim=-1)


def normalised_entropy(scores: Tensor) -> Tensor:
    """`[C, L]` token scores -> `[C]` entropy of each row as a distribution (rebased at 0 if negative) / log L."""
    if scores.shape[-1] == 1:
        return torch.zeros(scores.shape[0], device=scores.device)
    shifted = scores - scores.amin(dim=-1, keepdim=True).clamp(max=0.0)
    p = shifted / (shifted.sum(dim=-1, keepdim=True) + EPSILON)
    return (-(p * (p + EPSILON).log()).sum(dim=-1) / math.log(scores.shape[-1])).clamp(0.0, 1.0)


@dataclass
class KvpressWindowScorer(Method):
    """Scores entries as kvpress's SnapKVPress (`kvpress_snapkv_scores`): its window, pooling and checks, shared by
    ChunkKV and CriticalKV."""

    window: int = 64  # last prompt queries that score the entries (kvpress SnapKVPress window_size)
    kernel: int = 5
    pooling: Literal["avg", "max", "none"] = "avg"

    def __post_init__(self):
        name = type(self).registry_name
        if self.window < 1:
            raise ValueError(f"{name}: window={self.window} must be >= 1")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"{name}: kernel={self.kernel} must be odd and >= 1 (length-preserving pooling)")
        if self.pooling not in ("avg", "max", "none"):
            raise ValueError(f"{name}: pooling={self.pooling!r} is not one of avg, max, none")

    @property
    def query_window(self) -> int:
        return self.window

    def check_budget(self, budget: int | None) -> None:
        super().check_budget(budget)
        self.check_below_budget("window", budget, "the window's entries score highest")

    def snapkv_scores(self, view: LayerView) -> Tensor:
        return kvpress_snapkv_scores(view, self.window, self.kernel, self.pooling)


@METHODS.register("chunkkv")
@dataclass
class ChunkKV(KvpressWindowScorer):
    chunk_length: int = 20  # entries per chunk (kvpress ChunkKVPress; its entropy-gated press: 10)
    entropy_gate: bool = False  # kvpress EntropyGatedChunkKVPress
    low_entropy_chunk_length: int = 4  # entries a spiky chunk keeps under the gate

    def __post_init__(self):
        super().__post_init__()
        if self.chunk_length < 1:
            raise ValueError(f"chunkkv: chunk_length={self.chunk_length} must be >= 1")
        if self.entropy_gate and not self.chunk_length > self.low_entropy_chunk_length >= 1:
            raise ValueError(f"chunkkv: low_entropy_chunk_length={self.low_entropy_chunk_length} must be in [1, "
                             f"chunk_length={self.chunk_length}) with entropy_gate=true")

    def token_scores(self, view: LayerView) -> Tensor:
        return self.snapkv_scores(view)

    def keep_row(self, scores: Tensor, n_keep: int) -> Tensor:
        """One batch row's token scores `[n]` (summed over heads) -> the kept positions `[n_keep]`, sorted."""
        n, c = scores.shape[0], self.chunk_length
        bounds = [(s, min(s + c, n)) for s in range(0, n, c)]
        chunk_scores = torch.stack([scores[s:e].mean() for s, e in bounds])
        spiky = [False] * len(bounds)
        if self.entropy_gate:
            full = n // c
            entropy = normalised_entropy(scores[: full * c].view(full, c)) if full else scores.new_zeros(0)
            if n % c:
                entropy = torch.cat([entropy, normalised_entropy(scores[full * c:].view(1, -1))])
            spiky = ((chunk_scores >= chunk_scores.median()) & (entropy < entropy.median())).tolist()
        keep = torch.zeros(n, dtype=torch.bool, device=scores.device)
        left = n_keep
        for i in torch.argsort(chunk_scores, descending=True).tolist():
            if left <= 0:
                break
            s, e = bounds[i]
            take = min(e - s, left, self.low_entropy_chunk_length if spiky[i] else e - s)
            if take == e - s:
                keep[s:e] = True
            else:
                keep[s + scores[s:e].topk(take).indices] = True
            left -= take
        if left > 0:  # spiky chunks left budget over: the best remaining tokens
            rest = (~keep).nonzero().squeeze(-1)
            keep[rest[scores[rest].topk(min(left, rest.numel())).indices]] = True
        return keep.nonzero().squeeze(-1)

    def select(self, view: LayerView, n_keep: int) -> Tensor:
        scores = self.token_scores(view).sum(dim=1)  # [B, n]: one choice for every head of a layer
        h = view.keys.shape[1]
        return torch.stack([self.keep_row(row, n_keep) for row in scores]).unsqueeze(1).expand(-1, h, -1)
