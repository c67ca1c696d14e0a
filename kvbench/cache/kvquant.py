"""KVQuant-style storage (Hooper et al., arXiv 2401.18079): keys quantized per channel BEFORE RoPE, values per token,
each with dense-and-sparse outliers. What `method=kvquant` builds. Pure PyTorch.

The authors' code (SqueezeAILab/KVQuant) quantizes with CUDA kernels and offline-calibrated non-uniform datatypes
and thresholds; this is an independent implementation of the paper's equations with uniform codes:
- keys: the post-RoPE keys the cache holds are rotated back to their pre-RoPE form (`Rotary.unrotate`, the layer's
  angles, positions 0..n-1), since RoPE mixes channel pairs by position and blurs the per-channel outlier structure;
- dense-and-sparse: per vector (keys: a channel over the prompt's tokens; values: a token's channels in one head), the
  `outliers / 2` share of largest and of smallest entries (at least one each when `outliers` > 0) are kept exactly
  in a sparse part (values in the model's dtype, int32 offsets); the dense part is clamped to the range left
  (the paper's thresholds, computed online per vector here instead of calibrated offline) and quantized uniformly by
  the shared quantizer (`kvbench.cache.quantizer`, TailorKV's arithmetic: fp16 scale and zero): keys in groups of
  `group` tokens per channel (tokens past the last whole group stay full precision), values in groups of
  min(group, D) channels per token;
- read back: dequantize, write the outliers over, rotate keys to their positions again.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvbench.cache.kv_cache import KVLayer
from kvbench.cache.prompt_stored import PromptStoredLayer
from kvbench.cache.quantizer import Quantized, quantize


def rotate(x: Tensor, positions: Tensor, rotary) -> Tensor:
    """Encoded vectors from pre-encoding ones `[..., P, D]` at `positions` `[P]`: the inverse of `rotary.unrotate`
    (`rotary`: the layer's `kvbench.models.rotary.Rotary`, handed down by the method; cache/ imports nothing above it)."""
    x = x.float()
    if rotary.theta.numel() == 0:
        return x
    a, b = (i.to(x.device) for i in rotary.pairs(x.shape[-1]))
    angle = positions.double()[..., None] * rotary.theta.double().to(positions.device)
    cos, sin = (t.float().to(x.device) for t in (angle.cos(), angle.sin()))
    xa, xb = x[..., a], x[..., b]
    out = x.clone()
    out[..., a] = (xa * cos - xb * sin) * rotary.scale
    out[..., b] = (xb * cos + xa * sin) * rotary.scale
    return out


def outliers_per_side(length: int, share: float) -> int:
    """Entries kept exactly at each end of a vector of `length`: share / 2 of it, at least one if share > 0."""
    return 0 if share <= 0 else max(1, int(length * share / 2))


@dataclass
class DenseSparse:
    """Vectors along the last dim of `[..., L]`: the clamped dense part quantized (first `whole` entries; the rest full
    precision) and the outliers (offsets and exact values)."""

    dense: Quantized | None
    tail: Tensor
    outlier_idx: Tensor
    outlier_val: Tensor

    def read(self) -> Tensor:
        parts = [self.dense.dequantize()] if self.dense is not None else []
        x = torch.cat([*parts, self.tail.float()], dim=-1)
        return x.scatter(-1, self.outlier_idx.long(), self.outlier_val.float())

    def nbytes(self) -> int:
        return (self.dense.nbytes() if self.dense is not None else 0) + sum(
            t.numel() * t.element_size() for t in (self.tail, self.outlier_idx, self.outlier_val))


def dense_and_sparse(x: Tensor, bits: int, group: int, share: float, dtype: torch.dtype) -> DenseSparse:
    """Split vectors `x` `[..., L]` (fp32) into outliers and a clamped dense part quantized in groups along L."""
    length = x.shape[-1]
    k = outliers_per_side(length, share)
    if k:
        low, high = x.topk(k + 1, dim=-1, largest=False), x.topk(k + 1, dim=-1, largest=True)
        idx = torch.cat([low.indices[..., :k], high.indices[..., :k]], dim=-1)
        dense = x.clamp(low.values[..., k:], high.values[..., k:])  # the range left once the outliers are out
    else:
        idx, dense = x.new_zeros(*x.shape[:-1], 0, dtype=torch.long), x
    whole = length // group * group
    quantized = quantize(dense[..., :whole], bits, group, dim=-1) if whole else None
    return DenseSparse(quantized, dense[..., whole:].to(dtype).clone(), idx.to(torch.int32),
                       x.gather(-1, idx).to(dtype))


class KVQuantLayer(PromptStoredLayer):
    """A layer whose prompt K/V is stored KVQuant-style; tokens appended later stay full precision."""

    store_name = "KVQuant"

    @classmethod
    def from_layer(cls, layer: KVLayer, rotary, bits: int, group: int, share: float,
                   quantize_values: bool = True) -> KVQuantLayer:
        new = cls()
        keys, values = layer.keys, layer.values
        n = keys.shape[2]
        new.start_from(layer)
        new.rotary = rotary
        pre_rope = rotary.unrotate(keys, torch.arange(n, device=keys.device))  # [B, H, n, D] fp32
        new.stored_keys = dense_and_sparse(pre_rope.transpose(-1, -2), bits, group, share, keys.dtype)  # per channel
        if quantize_values:  # per token, groups of min(group, D) channels
            new.stored_values = dense_and_sparse(values.float(), bits, min(group, values.shape[-1]), share,
                                                 values.dtype)
        else:  # keys alone (the values kept as they are)
            none = values.new_zeros(*values.shape[:-1], 0)
            new.stored_values = DenseSparse(None, values.clone(), none.to(torch.int32), none)
        return new

    def prompt_kv(self) -> tuple[Tensor, Tensor]:
        """The prompt's keys (rotated to positions 0..n-1) and values, read back, fp32 `[B, H, n, D]`."""
        positions = torch.arange(self.prompt_len, device=self.keys.device)
        keys = rotate(self.stored_keys.read().transpose(-1, -2), positions, self.rotary)
        return keys, self.stored_values.read()

    def prompt_nbytes(self) -> int:
        return self.stored_keys.nbytes() + self.stored_values.nbytes()
