"""Position shift ("pos-shift", StreamingLLM/BUZZ): re-rotate cached keys so kept entries sit at consecutive slots.

Keys are cached after RoPE at their recorded positions p. Rotations compose, R(slot) = R(slot - p) R(p), so
rotating a cached key by (slot - p) places it at its slot without recomputing it. Afterwards the layer's positions
are the slots 0..T-1, and the next token goes at position T (the cache length). Uses the model's `inv_freq` (found
by its family adapter) and rotates only the rotary dims (partial rotary); RoPE variants with an attention scaling
factor other than 1 (YaRN, LongRoPE) are not supported.
"""
from __future__ import annotations

import torch
from torch import Tensor

from kvbench.cache.kv_cache import KVLayer


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def shift_to_slots(layer: KVLayer, inv_freq: Tensor) -> None:
    """Re-rotate `layer`'s keys from their recorded positions to slots 0..T-1 and record the slots. Only the first
    `2 * len(inv_freq)` dims rotate (partial rotary, GPT-NeoX / Phi); the rest carry no position."""
    if getattr(layer, "is_varlen", False):
        raise NotImplementedError("positions=shift: per-head variable layers are not supported")
    t = layer.keys.shape[-2]
    slots = torch.arange(t, device=layer.keys.device)
    delta = (slots - layer.positions).to(torch.float32)  # [B, H, T], <= 0
    if bool((delta == 0).all()):
        return
    angles = delta[..., None] * inv_freq.to(layer.keys.device).float()  # [B, H, T, R/2]
    angles = torch.cat([angles, angles], dim=-1)
    rot = angles.shape[-1]
    keys = layer.keys.float()
    head = keys[..., :rot] * angles.cos() + rotate_half(keys[..., :rot]) * angles.sin()
    layer.keys = torch.cat([head, keys[..., rot:]], dim=-1).to(layer.keys.dtype)
    layer.positions = slots.expand_as(layer.positions).clone()


def model_inv_freq(model, adapter) -> Tensor:
    """The rotary inverse frequencies shared by all layers of `model` (its family's adapter says where they are)."""
    return adapter.inv_freq(model)
