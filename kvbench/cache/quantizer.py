"""The KV quantizer shared by every quantized store (TailorKV's layers, KIVI, `+method.quantize`, GEAR, KVQuant-style
keys): uniform asymmetric quantization in groups along one axis, codes bit-packed into real bytes. Pure PyTorch.

    q = quantize(x, bits=2, group=32, dim=-2)     # groups of 32 consecutive entries along dim -2
    x_hat = q.dequantize()                        # same shape as x; q.nbytes() = packed codes + scales + zeros

Per group: zero = min, scale = (max - min) / (2^b - 1), code = round(clamp((x - zero) / scale, 0, 2^b - 1)) with
torch's half-to-even rounding; dequantized = code * scale + zero. Two arithmetic rules, chosen per call:
- `tailorkv` (the default, TailorKV's spec): min/max and the division in fp32, scale and zero stored in fp16 (as the
  paper says) and the codes computed from those fp16-rounded values, so dequantization is consistent; dequantized in
  fp32.
- `kivi`: the KIVI authors' code (jy-yuan/KIVI @876b4d2, `quant/new_pack.py`: `quant_and_pack_vcache`,
  `quant_and_pack_kcache`, `unpack_and_dequant_vcache`, and the pure-torch steps of
  `triton_quantize_and_pack_along_last_dim`): every step in the input's dtype (fp16 in their runs), scale and zero
  stored in that dtype, dequantized as `code.to(fp16) * scale + zero` (promoted to the scale's dtype). On the same
  tensors it gives the reference's codes, scales, zeros, packed bytes and dequantized values bit for bit
  (tests/unit/test_quantizer_kivi.py, goldens made by running the reference functions).
A constant group (scale 0, where both references divide by zero and get NaN codes) gets codes 0 and dequantizes to
its min, under either rule.

Packing: codes go into uint8 along the quantized axis, 8 / b codes per byte, the first code in the lowest bits. That
is KIVI's int32 packing (32 / b codes per int32, code j at bit j * b) read as little-endian bytes, so the stored
bytes equal the reference's. Bits 1, 2, 4, 8 (KIVI's code packs 2, 4, 8; TailorKV adds 1).

Storage layout: the quantized axis is moved last (`Quantized.packed` `[..., L * b / 8]`, `scale`/`zero`
`[..., L / group]`); `dim` records where it was, and `dequantize` moves it back.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

BITS = (1, 2, 4, 8)
ARITHMETIC = ("tailorkv", "kivi")


@dataclass
class Quantized:
    """A tensor quantized in groups along axis `dim` (of the original layout; negative): packed codes
    `[..., length * bits / 8]` uint8 with that axis last, `scale` and `zero` `[..., length / group]`."""

    packed: Tensor
    scale: Tensor
    zero: Tensor
    bits: int
    group: int
    length: int
    dim: int = -1
    arithmetic: str = "tailorkv"

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The tensor back in its original layout: code * scale + zero (fp32 under `tailorkv`, the scale's dtype
        under `kivi`), then cast to `dtype`."""
        codes = unpack(self.packed, self.bits, self.length).unflatten(-1, (-1, self.group))
        if self.arithmetic == "kivi":  # the reference: data.to(fp16) * scale + mn, promoted to the scale's dtype
            x = codes.to(torch.float16) * self.scale[..., None] + self.zero[..., None]
        else:
            x = codes.float() * self.scale.float()[..., None] + self.zero.float()[..., None]
        return x.flatten(-2).movedim(-1, self.dim).to(dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.zero))


def quantize(x: Tensor, bits: int, group: int, dim: int = -1, arithmetic: str = "tailorkv") -> Quantized:
    """Quantize `x` in groups of `group` consecutive elements along `dim` (its length a multiple of `group`, and
    of 8 / bits for the packing)."""
    if bits not in BITS:
        raise ValueError(f"quantize: bits={bits} is not one of {BITS}")
    if arithmetic not in ARITHMETIC:
        raise ValueError(f"quantize: arithmetic={arithmetic!r} is not one of {', '.join(ARITHMETIC)}")
    dim = dim - x.dim() if dim >= 0 else dim
    x = x.movedim(dim, -1)
    length = x.shape[-1]
    if length % group:
        raise ValueError(f"quantize: the quantized dim ({length}) is not a multiple of group={group}")
    top = 2**bits - 1
    if arithmetic == "kivi":  # every step in x's dtype, in the reference's order
        g = x.unflatten(-1, (-1, group))
        zero, scale = g.amin(dim=-1), (g.amax(dim=-1) - g.amin(dim=-1)) / top
        s = scale[..., None]
        safe = torch.where(s != 0, s, torch.ones_like(s))
        codes = ((g - zero[..., None]) / safe).clamp(0, top).round()
    else:
        g = x.float().unflatten(-1, (-1, group))  # [..., L / group, group]
        mn, mx = g.amin(dim=-1), g.amax(dim=-1)
        zero, scale = mn.half(), ((mx - mn) / top).half()
        z, s = zero.float()[..., None], scale.float()[..., None]
        safe = torch.where(s > 0, s, torch.ones_like(s))
        codes = ((g - z) / safe).clamp(0, top).round()
    codes = torch.where(s != 0, codes, torch.zeros_like(codes))  # constant group: codes 0, dequantizes to its min
    return Quantized(pack(codes.flatten(-2).to(torch.uint8), bits), scale, zero, bits, group, length, dim,
                     arithmetic)


def pack(codes: Tensor, bits: int) -> Tensor:
    """uint8 codes `[..., L]` (each < 2^bits) -> `[..., L * bits / 8]` uint8; code j of a byte sits at bit j * bits."""
    per = 8 // bits
    if codes.shape[-1] % per:
        raise ValueError(f"pack: the last dim ({codes.shape[-1]}) is not a multiple of {per} ({bits}-bit codes)")
    shifts = torch.arange(0, 8, bits, device=codes.device, dtype=torch.uint8)
    return (codes.unflatten(-1, (-1, per)) << shifts).sum(dim=-1, dtype=torch.uint8)  # disjoint bits: sum == or


def unpack(packed: Tensor, bits: int, length: int) -> Tensor:
    """Inverse of `pack`: `[..., L * bits / 8]` uint8 -> codes `[..., length]` uint8."""
    shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.uint8)
    codes = (packed[..., None] >> shifts) & (2**bits - 1)
    return codes.flatten(-2)[..., :length]


def cat(a: Quantized | None, b: Quantized, dim: int) -> Quantized:
    """Concatenate two quantized tensors along `dim` of their original layout (`a` may be None). Along the quantized
    axis `a` must end on a byte and a group boundary, which whole blocks of groups do; along any other axis the
    quantized lengths must match."""
    if a is None:
        return b
    if (a.bits, a.group, a.dim, a.arithmetic) != (b.bits, b.group, b.dim, b.arithmetic):
        raise ValueError("quantize: cannot concatenate tensors with different bits, group, axis or arithmetic")
    n = a.packed.dim()
    dim, qdim = dim % n, a.dim % n
    along = dim == qdim
    if along and (a.length * a.bits % 8 or a.length % a.group):
        raise ValueError(f"quantize: a block of length {a.length} does not end on a byte and group boundary")
    if not along and a.length != b.length:
        raise ValueError(f"quantize: lengths {a.length} and {b.length} differ")
    stored = n - 1 if along else [i for i in range(n) if i != qdim].index(dim)  # the axis in the stored layout
    parts = [torch.cat([x, y], dim=stored) for x, y in ((a.packed, b.packed), (a.scale, b.scale), (a.zero, b.zero))]
    return Quantized(*parts, a.bits, a.group, a.length + b.length if along else a.length, a.dim, a.arithmetic)
