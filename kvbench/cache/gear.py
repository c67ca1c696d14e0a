"""GEAR (Kang et al., arXiv 2403.05527): a prompt's K/V stored as a quantized backbone + sparse outliers + a low-rank
approximation of what the two leave over. What `method=gear` builds. Pure PyTorch.

Follows the authors' simulated compression (opengear-project/GEAR @ efe0bfe,
`GenerationBench/GenerationTest/GEARLM/Simulated/compress_function.py`: `gearslkivi_channelQ_new` for keys,
`gearslkivi_tokenQ_new` for values, `fake_poweriteration_group`), stored for real:
- outliers (GEAR-S): per row (keys: each channel over the tokens; values: each token over all heads' channels, the
  reference's `[B, T, H x D]` layout), the k largest and k smallest entries, k = int(int(numel x sparsity) / B / T / 2)
  (the reference's count), are kept exactly (values in the model's dtype, int32 row offsets) and replaced by the row
  mean before quantization;
- the backbone: KIVI-style asymmetric quantization through the shared quantizer (`kvbench.cache.quantizer`, its
  `kivi` arithmetic, which is the reference's fp32 steps): keys per channel in groups of `group` tokens (tokens past
  the last whole group stay full precision, as the reference concatenates them), values per token in groups of
  `group` of the H x D channels (so `group` must divide H x D);
- the reference rounds the backbone with its outliers to fp16 (`.half()`); kvbench does too before adding the rest;
- the low-rank part (GEAR-L): rank-`rank` power iteration (`loop` rounds, QR on the last) on each head's `[T, D]`
  error, from uniform random starts drawn from a seeded generator in the reference's order (P `[B, H, D, r]`, then
  Q `[B, H, T, r]`); stored as Q and P.
Read back: fp16(backbone with outliers written back) + Q Pᵀ, fp32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvbench.cache.kv_cache import KVLayer
from kvbench.cache.prompt_stored import PromptStoredLayer
from kvbench.cache.quantizer import Quantized, quantize

GEAR_BITS = (2, 4)  # the reference's levels are bits ** 2 - 1, which equals 2 ** bits - 1 only for 2 and 4


@dataclass
class GearStates:
    """One of K (`axis="channel"`) or V (`axis="token"`) of a layer's prompt, compressed."""

    axis: str
    shape: tuple[int, int, int, int]  # [B, H, T, D]
    backbone: Quantized | None  # keys: `[B, H, T', D]` grouped along tokens; values: `[B, T, H x D]` along channels
    tail: Tensor  # keys: the last T mod group tokens `[B, H, t, D]`, full precision; values: empty
    outlier_idx: Tensor  # int32 `[rows..., 2k]` offsets along each row
    outlier_val: Tensor  # `[rows..., 2k]`
    q: Tensor  # [B, H, T, r]
    p: Tensor  # [B, H, D, r]

    def read(self) -> Tensor:
        """The states back, fp32 `[B, H, T, D]`."""
        b, h, t, d = self.shape
        if self.axis == "channel":
            parts = [self.backbone.dequantize()] if self.backbone is not None else []
            backbone = torch.cat([*parts, self.tail.float()], dim=2).transpose(-1, -2)  # rows [B, H, D, T]
            backbone = backbone.scatter(-1, self.outlier_idx.long(), self.outlier_val.float()).transpose(-1, -2)
        else:
            rows = self.backbone.dequantize().scatter(-1, self.outlier_idx.long(), self.outlier_val.float())
            backbone = rows.view(b, t, h, d).transpose(1, 2)
        return backbone.half().float() + self.q.float() @ self.p.float().transpose(-1, -2)

    def nbytes(self) -> int:
        tensors = (self.tail, self.outlier_idx, self.outlier_val, self.q, self.p)
        return (self.backbone.nbytes() if self.backbone is not None else 0) + sum(
            x.numel() * x.element_size() for x in tensors)


def outlier_count(shape: tuple[int, ...], sparsity: float) -> int:
    """k, the reference's count of largest (and of smallest) entries kept per row."""
    b, h, t, d = shape
    return int(int(b * h * t * d * sparsity) / b / t / 2)


def power_iteration(error: Tensor, rank: int, loop: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Q `[B, H, T, r]`, P `[B, H, D, r]` with Q Pᵀ ≈ `error` `[B, H, T, D]` (the reference's iteration)."""
    b, h, t, d = error.shape
    p = torch.rand(b, h, d, rank, generator=generator, device=error.device)
    q = torch.rand(b, h, t, rank, generator=generator, device=error.device)
    for i in range(loop):
        if i == loop - 1:
            p = torch.linalg.qr(p).Q
        q = error @ p
        if i == loop - 1:
            q = torch.linalg.qr(q).Q
        p = error.transpose(-1, -2) @ q
    return q, p


def compress(x: Tensor, axis: str, bits: int, group: int, sparsity: float, rank: int, loop: int,
             generator: torch.Generator) -> GearStates:
    """GEAR's compression of states `x` `[B, H, T, D]` along `axis` (see the module docstring)."""
    b, h, t, d = x.shape
    xf = x.float()
    rows = xf.transpose(-1, -2) if axis == "channel" else xf.transpose(1, 2).reshape(b, t, h * d)
    k = outlier_count(tuple(x.shape), sparsity)
    small = rows.topk(k, dim=-1, largest=False)
    large = rows.topk(k, dim=-1, largest=True)
    mean = rows.mean(dim=-1, keepdim=True).expand_as(rows)
    flat = rows.scatter(-1, small.indices, mean.gather(-1, small.indices))
    flat = flat.scatter(-1, large.indices, mean.gather(-1, large.indices))
    idx = torch.cat([small.indices, large.indices], dim=-1)
    val = torch.cat([small.values, large.values], dim=-1)
    if axis == "channel":  # groups of `group` tokens per channel; the tokens past the last whole group stay
        whole = t // group * group
        states = flat.transpose(-1, -2)
        backbone = quantize(states[:, :, :whole], bits, group, dim=-2, arithmetic="kivi") if whole else None
        tail = states[:, :, whole:].to(x.dtype).clone()
    else:
        backbone, tail = quantize(flat, bits, group, dim=-1, arithmetic="kivi"), x.new_zeros(0)
    stored = GearStates(axis, (b, h, t, d), backbone, tail, idx.to(torch.int32), val.to(x.dtype),
                        x.new_zeros(b, h, t, 0), x.new_zeros(b, h, d, 0))
    if rank:
        q, p = power_iteration(xf - stored.read(), rank, loop, generator)
        stored.q, stored.p = q.to(x.dtype), p.to(x.dtype)
    return stored


class GearLayer(PromptStoredLayer):
    """A layer whose prompt K/V is GEAR-compressed; tokens appended later stay full precision in its dense part."""

    store_name = "GEAR"

    @classmethod
    def from_layer(cls, layer: KVLayer, bits: int, group: int, sparsity: float, rank: int, loop: int,
                   generator: torch.Generator) -> GearLayer:
        new = cls()
        new.start_from(layer)
        new.gear_keys = compress(layer.keys, "channel", bits, group, sparsity, rank, loop, generator)
        new.gear_values = compress(layer.values, "token", bits, group, sparsity, rank, loop, generator)
        return new

    def prompt_kv(self) -> tuple[Tensor, Tensor]:
        return self.gear_keys.read(), self.gear_values.read()

    def prompt_nbytes(self) -> int:
        """Packed codes, scales and zeros, full-precision key tail, outliers and their offsets, Q and P."""
        return self.gear_keys.nbytes() + self.gear_values.nbytes()
