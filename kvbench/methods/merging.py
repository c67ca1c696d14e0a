"""Merge on evict (kvpress 0.5.5 `MergingPress`, after Token Merging and D2O): the entries a selection evicts are not
simply dropped; each one's value is folded into the value of the kept entry whose key is most cosine-similar in the
same KV head, weighted by that similarity and by the evicted value's share of the two values' norms. Keys stay as
they are (their RoPE positions too). The switch `+method.merge=true` (kvbench/methods/wrappers.py `Merge`) applies it
between any selector's `select` and the cache's gather (kvbench/engine/generation.py `compress_layer`).

For one head, evicted entry e goes to t = argmax_k cos(key_e, key_k) over the kept k, with weight
w_e = max(cos, 0) |v_e| / (|v_e| + |v_t| + eps), where only entries whose cosine reaches `threshold` (and, with
`fraction` < 1, lies in the top `fraction` of the passing cosines: torch.quantile, as kvpress) merge. Each kept entry
that received any weight becomes (v_t + sum_e w_e v_e) / (1 + sum_e w_e); the others keep their value.
"""
from __future__ import annotations

import torch
from torch import Tensor

EPS = 1e-6  # kvpress's: safe in float16 and bfloat16


def evicted_complement(kept: Tensor, n: int) -> Tensor:
    """The entries not in `kept` `[B, H, k]` (distinct indices into n), ascending: `[B, H, n - k]`."""
    evicted = torch.ones(*kept.shape[:2], n, dtype=torch.bool, device=kept.device).scatter(2, kept, False)
    order = torch.arange(n, device=kept.device).expand_as(evicted)
    # ascending positions first: kept slots are pushed past n, then cut off
    return order.masked_fill(~evicted, n).sort(dim=-1).values[..., :n - kept.shape[-1]]


def merge_gate(similarity: Tensor, threshold: float, fraction: float) -> Tensor:
    """Which evicted entries merge `[B, H, e]`: cosine >= `threshold`, and among those the top `fraction`."""
    passes = similarity >= threshold
    if fraction < 1.0 and bool(passes.any()):
        cut = similarity.masked_fill(~passes, float("-inf")).quantile(1.0 - fraction, dim=-1, keepdim=True)
        passes &= similarity >= cut
    return passes


def merged_kept_values(keys: Tensor, values: Tensor, kept: Tensor, threshold: float = 0.0,
                       fraction: float = 1.0) -> Tensor:
    """The kept entries' values `[B, H, k, D]` (in `kept`'s order) once every evicted entry is folded in; `keys`,
    `values`: the layer's `[B, H, n, D]`, `kept`: `[B, H, k]`. Accumulates in float32, returns `values`' dtype."""
    n, d = keys.shape[-2], keys.shape[-1]
    k = kept.shape[-1]
    gather_kept = kept.unsqueeze(-1).expand(-1, -1, -1, d)
    kept_values = values.gather(2, gather_kept)
    if k in (0, n):
        return kept_values
    evicted = evicted_complement(kept, n).unsqueeze(-1).expand(-1, -1, -1, d)
    unit_kept = unit_rows(keys.gather(2, gather_kept).float())
    unit_evicted = unit_rows(keys.gather(2, evicted).float())
    similarity, target = (unit_evicted @ unit_kept.transpose(-2, -1)).max(dim=-1)  # [B, H, e]
    evicted_values = values.gather(2, evicted).float()
    evicted_norm, target_norm = evicted_values.norm(dim=-1), kept_values.float().norm(dim=-1).gather(2, target)
    weight = similarity.clamp(min=0) * merge_gate(similarity, threshold, fraction)
    weight = weight * evicted_norm / (evicted_norm + target_norm + EPS)
    added = torch.zeros(*kept.shape, d, dtype=torch.float32, device=keys.device)
    added.scatter_add_(2, target.unsqueeze(-1).expand(-1, -1, -1, d), weight.unsqueeze(-1) * evicted_values)
    total = torch.zeros(kept.shape, dtype=torch.float32, device=keys.device).scatter_add_(2, target, weight)
    merged = ((kept_values.float() + added) / (1.0 + total).unsqueeze(-1)).to(values.dtype)
    return torch.where((total > 0).unsqueeze(-1), merged, kept_values)


def unit_rows(x: Tensor) -> Tensor:
    """Rows scaled to unit norm (norms clamped at EPS, as kvpress)."""
    return x / x.norm(dim=-1, keepdim=True).clamp(min=EPS)
