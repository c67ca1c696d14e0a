"""Two adjacent layers' prompt K/V stored once (MiniCache, arXiv 2405.14366): what `method=minicache` builds.

Per token and head, the two layers' states (keys, and values, each on their own) are split into magnitude and
direction; the directions are merged by SLERP with interpolation t (previous layer weight sin((1 - t) θ) / sin θ,
current sin(t θ) / sin θ, θ their angle; plain LERP where sin θ vanishes) and renormalised. Stored per pair: the shared
direction once `[B, H, n, D]`, each layer's magnitude `[B, H, n, 1]`, and the tokens whose directions disagree most
(angle / π largest, ceil(ratio x n) per head: MiniCache's retention) kept whole for both layers with their indices.
A layer reads its states back as direction x its magnitude, its retained tokens written over them. Tokens appended
after the prompt (generated, fed) stay full precision in each layer's own dense part. The math follows
KVCache-Factory's `pyramidkv/minicache.py` @ c97f9d7 (`compress_minicache_pair`, `restore_minicache_pair`), computed
in fp32 and stored in the model's dtype.

Bytes: the shared direction and the retained indices are counted once (by the pair's deeper layer), each layer's
magnitudes, retained tokens and dense part by that layer: the sum over layers is what is held.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from kvbench.cache.kv_cache import KVLayer
from kvbench.cache.prompt_stored import PromptStoredLayer


@dataclass
class MergedStates:
    """One of K or V of a layer pair: the shared direction, the (previous, current) magnitudes and retained tokens."""

    direction: Tensor  # [B, H, n, D]
    magnitudes: tuple[Tensor, Tensor]  # [B, H, n, 1] each
    retained_idx: Tensor  # [B, H, r] int32, ascending
    retained: tuple[Tensor, Tensor]  # [B, H, r, D] each

    def restore(self, side: int) -> Tensor:
        """The states of the previous (side 0) or current (side 1) layer `[B, H, n, D]`, fp32."""
        states = self.direction.float() * self.magnitudes[side].float()
        idx = self.retained_idx.long()[..., None].expand(*self.retained_idx.shape, states.shape[-1])
        return states.scatter(2, idx, self.retained[side].float())

    def shared_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.direction, self.retained_idx))

    def side_nbytes(self, side: int) -> int:
        return sum(t.numel() * t.element_size() for t in (self.magnitudes[side], self.retained[side]))


def merge_states(previous: Tensor, current: Tensor, interpolation: float, retention_ratio: float,
                 eps: float = 1e-6) -> MergedStates:
    """MiniCache's merge of two layers' states `[B, H, n, D]` (see the module docstring)."""
    prev, cur = previous.float(), current.float()
    prev_mag, cur_mag = prev.norm(dim=-1, keepdim=True).clamp_min(eps), cur.norm(dim=-1, keepdim=True).clamp_min(eps)
    prev_unit, cur_unit = prev / prev_mag, cur / cur_mag
    angle = torch.acos((prev_unit * cur_unit).sum(dim=-1, keepdim=True).clamp(-1.0 + eps, 1.0 - eps))
    sin = torch.sin(angle)
    slerp = (torch.sin((1 - interpolation) * angle) / sin * prev_unit
             + torch.sin(interpolation * angle) / sin * cur_unit)
    lerp = (1 - interpolation) * prev_unit + interpolation * cur_unit
    direction = torch.where(sin.abs() > eps, slerp, lerp)
    direction = direction / direction.norm(dim=-1, keepdim=True).clamp_min(eps)
    n = prev.shape[2]
    count = min(n, math.ceil(n * retention_ratio))
    idx = (angle[..., 0] / math.pi).topk(count, dim=-1).indices.sort(dim=-1).values  # [B, H, r]
    rows = idx[..., None].expand(*idx.shape, prev.shape[-1])
    dtype = previous.dtype
    return MergedStates(direction.to(dtype), (prev_mag.to(dtype), cur_mag.to(dtype)), idx.to(torch.int32),
                        (previous.gather(2, rows).clone(), current.gather(2, rows).clone()))


class MergedLayer(PromptStoredLayer):
    """One layer of a merged pair: its prompt states read back from the pair, then its own dense part (tokens
    appended after the prompt, full precision). Built by `merge_pair`."""

    store_name = "merged"

    @classmethod
    def of_pair(cls, layer: KVLayer, keys: MergedStates, values: MergedStates, side: int) -> MergedLayer:
        new = cls()
        new.start_from(layer)
        new.merged_keys, new.merged_values, new.side = keys, values, side
        return new

    def prompt_kv(self) -> tuple[Tensor, Tensor]:
        return self.merged_keys.restore(self.side), self.merged_values.restore(self.side)

    def prompt_nbytes(self) -> int:
        """The shared parts once (the deeper layer counts them), this layer's magnitudes and retained tokens."""
        own = sum(m.side_nbytes(self.side) for m in (self.merged_keys, self.merged_values))
        if self.side == 1:
            own += sum(m.shared_nbytes() for m in (self.merged_keys, self.merged_values))
        return own


def merge_pair(previous: KVLayer, current: KVLayer, interpolation: float,
               retention_ratio: float) -> tuple[MergedLayer, MergedLayer]:
    """Two prefilled dense layers -> the two halves of their merged pair (no reference kept to their tensors)."""
    keys = merge_states(previous.keys, current.keys, interpolation, retention_ratio)
    values = merge_states(previous.values, current.values, interpolation, retention_ratio)
    return MergedLayer.of_pair(previous, keys, values, 0), MergedLayer.of_pair(current, keys, values, 1)
