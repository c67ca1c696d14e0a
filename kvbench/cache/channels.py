"""A dense layer whose prompt keys keep only some channels per head (ThinK), stored for real.

ThinK prunes the same number of key channels in every head, so the prompt's keys are stored `[B, H, T, D']` with
the channels each (row, head) kept `[B, H, D']`; values and positions stay whole. Keys appended later (generated or
fed tokens) keep every channel, as in kvpress's `ThinKPress`, which prunes the prompt's keys once. Attention reads
the layer through `decode_kv`: the prompt keys are put back at their channels with zeros elsewhere (what kvpress
computes with its zeroed keys), a transient of one layer's full keys per step, as the quantized layer's
dequantization. Nothing is evicted from it afterwards (`keep` refuses): it is the prompt's final form.
"""
from __future__ import annotations

import copy

import torch
from torch import Tensor

from kvbench.cache.kv_cache import DecodeKV, KVLayer


class ChannelPrunedLayer(KVLayer):
    own_storage = True  # attended through `decode_kv` only

    def __init__(self, layer: KVLayer, channels: Tensor):
        """`layer`'s entries with only `channels` `[B, H, D']` (sorted) of its keys, which it then frees."""
        super().__init__()
        if layer.repeat > 1 or layer.shift_inv_freq is not None:
            raise ValueError("cache: channel pruning needs a layer of KV heads at original positions")
        b, h, t, d = layer.keys.shape
        self.channels = channels.to(torch.int16)  # (D < 32768)
        self.prompt_keys = layer.keys.gather(-1, channels[:, :, None].expand(b, h, t, -1)).contiguous()
        self.head_dim = d
        self.keys = layer.keys.new_empty(b, h, 0, d)  # later tokens' keys, every channel
        self.values, self.positions, self.seen_tokens = layer.values, layer.positions, layer.seen_tokens
        self.dtype, self.device, self.is_initialized = layer.keys.dtype, layer.keys.device, True

    def full_prompt_keys(self) -> Tensor:
        """`[B, H, T, D]`: the kept channels at their places, zeros elsewhere."""
        b, h, t, _ = self.prompt_keys.shape
        full = self.prompt_keys.new_zeros(b, h, t, self.head_dim)
        return full.scatter_(-1, self.channels.long()[:, :, None].expand(b, h, t, -1), self.prompt_keys)

    def decode_kv(self, query: Tensor | None = None) -> DecodeKV:
        return DecodeKV(torch.cat([self.full_prompt_keys(), self.keys], dim=-2), self.values, None, self.positions)

    def keep(self, idx: Tensor) -> None:
        raise ValueError("cache: a channel-pruned layer (ThinK) keeps its entries; nothing evicts from it afterwards")

    def truncate(self, max_length: int) -> None:
        raise ValueError("cache: a channel-pruned layer (ThinK) cannot be truncated")

    def clone(self) -> "ChannelPrunedLayer":
        twin = copy.copy(self)
        for name in ("channels", "prompt_keys", "keys", "values", "positions"):
            setattr(twin, name, getattr(self, name).clone())
        return twin

    def nbytes(self) -> int:
        """Kept key channels, later keys, values and the channel index (int16)."""
        return sum(t.numel() * t.element_size() for t in (self.prompt_keys, self.keys, self.values, self.channels))

    def entries_per_head(self) -> list[int]:
        return [self.values.shape[-2]] * self.values.shape[1]
