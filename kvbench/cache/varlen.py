"""Per-head variable-length cache layer (Ada-KV).

After an Ada-style selection each head keeps a different number of prompt entries. They are stored flattened,
head after head, in `flat_keys/flat_values` `[N, D]` with offsets `cu` `[H + 1]` (the layout of the official
`DynamicCacheSplitHeadFlatten`), so memory is exactly the kept entries, no padding. Tokens generated afterwards
arrive one per head per step, so they go to an ordinary dense part `keys/values` `[1, H, t, D]`: the flattened
prompt part is never rewritten (the official CUDA kernel re-copies the whole layer every step).

Decode attention (`kvbench.engine.attention`, with every other sequence's layer) reads `decode_kv()`: the heads
padded to the longest for this step, then the dense part, with a mask of each head's entries; the padded copy is a
transient of the step, not what the layer holds. Batch size 1 per layer. Where each flattened entry lands is
computed once at selection (host ints for the sizes), so a step never waits on the device for them.
"""
from __future__ import annotations

import torch
from torch import Tensor

from kvbench.cache.kv_cache import DecodeKV, KVLayer


class VarlenLayer(KVLayer):
    """Flattened per-head prompt entries + a dense part for decoded tokens. Built by `from_selection`."""

    is_varlen = True
    own_storage = True

    @classmethod
    def from_selection(cls, layer: KVLayer, idx: list[Tensor]) -> "VarlenLayer":
        """Keep `idx[h]` (positions into `layer`'s entries) for each stored head h, or for each query head when
        `len(idx)` is a multiple of the stored heads (the per-query-head layout). Frees `layer`'s tensors."""
        if layer.keys.shape[0] != 1:
            raise ValueError("cache: per-head variable budgets support batch size 1")
        h_store = layer.keys.shape[1]
        if len(idx) % h_store:
            raise ValueError(f"cache: cannot select {len(idx)} heads from a layer holding {h_store}")
        rep = len(idx) // h_store
        new = cls()
        src = [(h // rep, i) for h, i in enumerate(idx)]
        new.flat_keys = torch.cat([layer.keys[0, kv, i] for kv, i in src])
        new.flat_values = torch.cat([layer.values[0, kv, i] for kv, i in src])
        new.flat_positions = torch.cat([layer.positions[0, kv, i] for kv, i in src])
        lens = torch.tensor([len(i) for i in idx], device=layer.keys.device)
        new.head_lens = lens
        new.cu = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
        new.offsets = new.cu.tolist()  # plain ints, host-side: sizes need no device sync
        new.max_head_len = max(len(i) for i in idx)
        heads = torch.arange(len(idx), device=lens.device)
        flat_head = heads.repeat_interleave(lens)  # each flat entry's head and place in it (decode padding)
        flat_slot = torch.arange(int(new.cu[-1]), device=lens.device) - new.cu[:-1].repeat_interleave(lens)
        slots = flat_head * new.max_head_len + flat_slot  # where each flat entry lands in [H * longest]
        new.prompt_source = torch.zeros(len(idx) * new.max_head_len, dtype=torch.long, device=lens.device)
        new.prompt_source[slots] = torch.arange(len(slots), device=lens.device)  # each slot's flat entry (padding:
        #                                                                           entry 0, masked by `valid`)
        new.prompt_valid = (torch.arange(new.max_head_len, device=lens.device)[None] < lens[:, None])[None]
        new.prompt_positions = new.flat_positions.new_zeros(len(idx), new.max_head_len)
        new.prompt_positions[flat_head, flat_slot] = new.flat_positions
        new.prompt_positions = new.prompt_positions[None]  # [1, H, longest]: padding reads position 0, masked
        empty = layer.keys.new_empty(1, len(idx), 0, layer.keys.shape[-1])
        new.keys, new.values = empty, empty.clone()
        new.positions = layer.positions.new_empty(1, len(idx), 0)
        new.dtype, new.device, new.is_initialized = layer.keys.dtype, layer.keys.device, True
        new.seen_tokens, new.repeat = layer.seen_tokens, layer.repeat * rep
        return new

    def decode_kv(self, query: Tensor | None = None) -> DecodeKV:
        """This step's keys/values `[1, H, longest + t, D]`: each head's prompt entries padded to the longest,
        then the t decoded tokens; `valid` masks the padding."""
        h, longest, t, d = len(self.offsets) - 1, self.max_head_len, self.keys.shape[-2], self.flat_keys.shape[-1]
        out = []  # (one row copy per slot; a padding slot copies entry 0, which `valid` masks)
        for flat, dense in ((self.flat_keys, self.keys), (self.flat_values, self.values)):
            prompt = flat.index_select(0, self.prompt_source).view(1, h, longest, d)
            out.append(torch.cat([prompt, dense], dim=2) if t else prompt)
        valid = torch.cat([self.prompt_valid, self.prompt_valid.new_ones(1, h, t)], dim=-1)
        return DecodeKV(*out, valid, torch.cat([self.prompt_positions, self.positions], dim=-1))

    def keep(self, idx: Tensor) -> None:
        raise NotImplementedError("cache: eviction after a per-head variable selection is not supported yet")

    def get_seq_length(self) -> int:
        return self.max_head_len + self.keys.shape[-2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[-2] + query_length, 0  # the dense part; varlen attention ignores masks (batch 1)

    def nbytes(self) -> int:
        flat = self.flat_keys.numel() * self.flat_keys.element_size() * 2
        return flat + self.keys.numel() * self.keys.element_size() * 2

    def entries_per_head(self) -> list[int]:
        return (self.head_lens + self.keys.shape[-2]).tolist()
