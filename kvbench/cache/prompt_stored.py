"""A layer whose prompt K/V is held in a compressed store of its own (GEAR, KVQuant, MiniCache's merged pairs) and
whose later tokens are appended full precision to a dense part: every token stays, so it never evicts.

Subclasses say how the prompt is read back (`prompt_kv`) and what its store holds (`prompt_nbytes`); the dense
part, positions, lengths and decode attention are the same for all of them.
"""
from __future__ import annotations

import torch
from torch import Tensor

from kvbench.cache.kv_cache import DecodeKV, KVLayer


class PromptStoredLayer(KVLayer):
    is_varlen = False
    is_croppable = False
    own_storage = True
    store_name = "prompt-stored"  # named in the refusal of eviction

    def start_from(self, layer: KVLayer) -> None:
        """Take the prefilled layer's device, dtype, length and positions; the dense part starts empty."""
        self.device, self.dtype, self.is_initialized = layer.keys.device, layer.keys.dtype, True
        self.prompt_len = layer.keys.shape[2]
        self.seen_tokens, self.repeat, self.positions = layer.seen_tokens, layer.repeat, layer.positions.clone()
        self.keys, self.values = layer.keys[:, :, :0].clone(), layer.values[:, :, :0].clone()

    def prompt_kv(self) -> tuple[Tensor, Tensor]:
        """The prompt's keys and values read back, fp32 `[B, H, n, D]`."""
        raise NotImplementedError

    def prompt_nbytes(self) -> int:
        raise NotImplementedError

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Append generated or fed tokens `[B, H_kv, q, D]` to the dense part; returns it."""
        b, h, q = key_states.shape[:3]
        new = torch.arange(self.seen_tokens, self.seen_tokens + q, device=key_states.device).expand(b, h, q)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.positions = torch.cat([self.positions, new], dim=-1)  # (every token stays: position = slot)
        self.seen_tokens += q
        return self.keys, self.values

    def decode_kv(self, query: Tensor | None = None) -> DecodeKV:
        """Every entry in position order, fp32: the prompt read back, then the dense part (a fed chunk's queries see
        it too; the caller masks them causally)."""
        keys, values = self.prompt_kv()
        return DecodeKV(torch.cat([keys, self.keys.float()], dim=-2), torch.cat([values, self.values.float()], dim=-2))

    def keep(self, idx: Tensor) -> None:
        raise NotImplementedError(f"cache: a {self.store_name} layer keeps every token; eviction does not apply")

    def get_seq_length(self) -> int:
        return self.prompt_len + self.keys.shape[-2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def nbytes(self) -> int:
        """The prompt's store plus the dense part."""
        return self.prompt_nbytes() + sum(t.numel() * t.element_size() for t in (self.keys, self.values))

    def entries_per_head(self) -> list[int]:
        return [self.get_seq_length()] * self.keys.shape[1]
