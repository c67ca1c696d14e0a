"""Position shift ("pos-shift", StreamingLLM/BUZZ): attention sees the kept keys at consecutive cache slots.

Keys are cached after RoPE at the position their token was computed at, and the cache never rewrites them: under
pos-shift a layer hands attention its keys rotated from those stored originals by the total position change, in
fp32, cast once (`shifted_keys`). Rotations compose, R(target) = R(target - p) R(p), so one exact rotation from the
original replaces a chain of per-eviction re-rotations whose roundings compound (500 one-slot shifts in bf16: 21 %
relative key error chained, about one bf16 rounding this way).

Targets: the newest entry (the current token) keeps the position it was computed at, P, and the other entries sit at
consecutive slots before it: entry i of T goes to P - (T - 1 - i). With one P for every layer (position_ids are
shared by the whole forward), each layer's query is thus at its own cache length relative to its keys, which is
what RoPE attention depends on, also when layers keep different numbers of entries (PyramidKV). Uses the model's
`inv_freq` (found by its family adapter) and rotates only the rotary dims (partial rotary; none for ALiBi, whose
bias reads the same targets through `KVLayer.attention_positions`); RoPE variants with an attention scaling factor
other than 1 (YaRN, LongRoPE) are not supported.
"""
from __future__ import annotations

import torch
from torch import Tensor


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rotate(keys: Tensor, delta: Tensor, inv_freq: Tensor) -> Tensor:
    """`keys` `[B, H, T, D]` rotated by `delta` `[B, H, T]` positions (HF rotate-half layout), fp32, cast once.
    Only the first `2 * len(inv_freq)` dims rotate (partial rotary, GPT-NeoX / Phi); the rest carry no position."""
    rot = 2 * inv_freq.shape[-1]
    if rot == 0:
        return keys
    angles = delta.to(torch.float32)[..., None] * inv_freq.to(keys.device, torch.float32)  # [B, H, T, R/2]
    angles = torch.cat([angles, angles], dim=-1)
    k = keys.float()
    head = k[..., :rot] * angles.cos() + rotate_half(k[..., :rot]) * angles.sin()
    return torch.cat([head, k[..., rot:]], dim=-1).to(keys.dtype)


def slot_targets(positions: Tensor) -> Tensor:
    """Where pos-shift places each entry `[B, H, T]`: entry i of T at P - (T - 1 - i), P = the newest entry's
    position (the current query's)."""
    t = positions.shape[-1]
    return torch.arange(t, device=positions.device) + (positions[..., -1:] - (t - 1))


def shifted_keys(keys: Tensor, positions: Tensor, inv_freq: Tensor) -> Tensor:
    """The stored keys as pos-shift attention sees them (at `slot_targets`); `positions` `[B, H, T]` are the
    positions the stored keys were rotated at."""
    delta = slot_targets(positions) - positions
    if keys.device.type == "cpu" and not bool(delta.any()):  # elsewhere the check would wait on the device every
        return keys  # step; rotating by 0 returns the keys unchanged anyway
    return rotate(keys, delta, inv_freq)


def model_inv_freq(model, adapter) -> Tensor:
    """The rotary inverse frequencies shared by all layers of `model` (its family's adapter says where they are)."""
    return adapter.inv_freq(model)
