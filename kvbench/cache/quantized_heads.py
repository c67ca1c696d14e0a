"""Per-head variable lengths, quantized (`+method.quantize` after Ada-KV, KVzip, CriticalKV's per-head budgets).

A `VarlenLayer` keeps a different number of entries in each head; KIVI's storage groups keys along tokens, so each
head is quantized as a layer of its own: one `QuantizedLayer` `[1, 1, len_h, D]` per stored head, each with its own
full-precision residual window and flushes (a head's key blocks fill as its own tokens arrive, and every head gets one
token per step, so all heads flush at the same steps, whatever their lengths). Memory is exactly each head's packed
codes, scales, zeros and residual. A decode step pads the heads' dequantized entries in front to the longest and masks
the padding (`DecodeKV.valid`); the padded copy is a transient of the step.
"""
from __future__ import annotations

import torch
from torch import Tensor

from kvbench.cache.kv_cache import DecodeKV, KVLayer
from kvbench.cache.quantized import QuantizedLayer


class QuantizedHeads(KVLayer):
    """One quantized store per head of a per-head variable layer. Built by `from_varlen`."""

    is_varlen = True
    is_croppable = False
    own_storage = True

    @classmethod
    def from_varlen(cls, layer, bits: int, group: int, residual: int, arithmetic: str) -> QuantizedHeads:
        """Quantize each head of `layer` (a `VarlenLayer` right after its selection: no decoded tokens yet)."""
        if layer.keys.shape[-2]:
            raise ValueError("cache: a per-head layer is quantized right after its selection, before decoding")
        new = cls()
        new.heads = []
        for h in range(len(layer.offsets) - 1):
            lo, hi = layer.offsets[h], layer.offsets[h + 1]
            head = KVLayer()
            head.update(layer.flat_keys[None, None, lo:hi], layer.flat_values[None, None, lo:hi])
            new.heads.append(QuantizedLayer.from_layer(head, bits, group, residual, arithmetic))
        new.device, new.dtype, new.is_initialized = layer.flat_keys.device, layer.flat_keys.dtype, True
        new.seen_tokens, new.repeat, new.positions = layer.seen_tokens, layer.repeat, None
        new.keys = new.values = layer.flat_keys.new_empty(1, len(new.heads), 0, layer.flat_keys.shape[-1])
        return new

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Append one step `[1, H_kv, 1, D]` (repeated to the stored heads in the per-query-head layout) to each
        head's store. Returns empty tensors: attention reads this layer through `decode_kv`."""
        if key_states.shape[-2] != 1:
            raise ValueError("cache: a quantized per-head layer takes one token per step (no fed chunk)")
        if self.repeat > 1:
            key_states = key_states.repeat_interleave(self.repeat, dim=1)
            value_states = value_states.repeat_interleave(self.repeat, dim=1)
        for h, head in enumerate(self.heads):
            head.update(key_states[:, h:h + 1], value_states[:, h:h + 1])
        self.seen_tokens += 1
        return self.keys, self.values

    def decode_kv(self, query: Tensor | None = None) -> DecodeKV:
        """Every head's entries dequantized (fp32), padded in front to the longest `[1, H, L, D]`; `valid` masks the
        padding, so the query's own token is the last entry of every row."""
        per_head = [head.decode_kv() for head in self.heads]
        lengths = [kv.keys.shape[-2] for kv in per_head]
        longest, d = max(lengths), per_head[0].keys.shape[-1]
        keys = per_head[0].keys.new_zeros(1, len(per_head), longest, d)
        values = torch.zeros_like(keys)
        valid = torch.zeros(1, len(per_head), longest, dtype=torch.bool, device=keys.device)
        for h, (kv, n) in enumerate(zip(per_head, lengths)):
            keys[0, h, longest - n:], values[0, h, longest - n:] = kv.keys[0, 0], kv.values[0, 0]
            valid[0, h, longest - n:] = True
        return DecodeKV(keys, values, valid)

    def keep(self, idx: Tensor) -> None:
        raise NotImplementedError("cache: a quantized layer keeps every token; eviction does not apply")

    def get_seq_length(self) -> int:
        return max(head.get_seq_length() for head in self.heads)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0  # decode attention ignores masks (one token, `valid`)

    def nbytes(self) -> int:
        return sum(head.nbytes() for head in self.heads)

    def entries_per_head(self) -> list[int]:
        return [head.get_seq_length() for head in self.heads]
