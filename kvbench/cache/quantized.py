"""KIVI's quantized cache layer (TailorKV's quantization-friendly layers, `method=kivi`, `+method.quantize`): 1 to 8
bits, pure PyTorch.

The quantizer is `kvbench.cache.quantizer` (uniform asymmetric per group, codes bit-packed into uint8, so `nbytes()`
is the memory a packed kernel would hold); `arithmetic` picks TailorKV's rule (fp32 math, fp16 scale and zero: the
default) or the KIVI authors' (every step in the cache's dtype).

`QuantizedLayer` follows the official `TailorKVCache` (ydyhello/TailorKV @4e9fc81, `models/cache_utils.py`):
- keys are quantized per channel: stored `[B, H, D, T]`, groups of `group` consecutive tokens; the last n mod
  `residual` prompt tokens stay full precision, and each time that residual reaches `residual` tokens it is quantized
  as one block (blocks are whole groups, so appending is concatenating along the packed axis);
- values are quantized per token: stored `[B, H, T, D]`, groups of min(group, D) channels; the last `residual` prompt
  tokens stay full precision, and from then on each step quantizes the oldest one (the window slides one token per
  step).
As in the official step, a decode step attends first and flushes after: the token that fills a key block attends
that block in full precision, and each step attends `residual + 1` full-precision values; the flush is carried out
when the next token arrives (`update`), so between steps the layer holds what the official one holds while it attends.
Decode attention reads the layer dequantized to fp32 (`decode_kv`; the official fused dequant-GEMV kernel is not
reimplemented), so each step holds a transient of 2 x T x D x H fp32 for this layer. Every token is kept, so eviction
(`keep`) is not supported; `positions` is None because nothing reads it for this layer (no eviction, no re-rotation).

Several tokens appended at once (`generation.feed`: query=agnostic's question, a conversation's later turns;
`append_chunk`) are stored as generated tokens are: they enter the full-precision residuals, the keys go in whole
blocks but one the chunk's last token just filled, and values older than the last `residual + 1` are quantized one
per token,
so the storage after a feed equals that after the same tokens appended one per step (quantization is per key block
and per value token, so the order of flushes does not change a code). The chunk attends the past as its first token's
step would (dequantized where quantized) and itself in full precision, causally: the official code's only
multi-token path is its prefill, which attends its own tokens unquantized and quantizes afterwards
(`TailorKVCache.quantize`); it has no append of several tokens on a quantized layer. One-token decoding differs only
where a flush falls inside the chunk: there token i sees earlier chunk tokens (and the oldest past values) already
quantized by the steps before it.
"""
from __future__ import annotations


import torch
from torch import Tensor

from kvbench.cache.kv_cache import DecodeKV, KVLayer
from kvbench.cache.quantizer import BITS, Quantized, cat, pack, quantize, unpack  # noqa: F401 (re-exported)


# --- the cache layer --------------------------------------------------------------------------------------------
class QuantizedLayer(KVLayer):
    """Quantized keys/values plus full-precision residual windows; see the module docstring. Built by `from_layer`.
    `keys`/`values` hold the fp key and value residuals `[B, H, t, D]` (of different lengths)."""

    is_varlen = False
    is_croppable = False
    own_storage = True

    @classmethod
    def from_layer(cls, layer: KVLayer, bits: int, group: int = 64, residual: int = 128,
                   arithmetic: str = "tailorkv") -> QuantizedLayer:
        """Quantize a filled prompt layer (n tokens). Values use groups of min(group, D) channels: the tiny test
        models have D = 16, real models 64 or 128. The new layer keeps no reference to `layer`'s tensors."""
        keys, values = layer.keys, layer.values
        n, d = keys.shape[-2:]
        group_v = min(group, d)
        if bits not in BITS:
            raise ValueError(f"quantize: bits={bits} is not one of {BITS}")
        if residual % group or group % (8 // bits) or d % group_v:
            raise ValueError(f"quantize: need residual ({residual}) a multiple of group ({group}), group a multiple "
                             f"of {8 // bits} ({bits}-bit packing), and head_dim ({d}) a multiple of {group_v}")
        new = cls()
        new.device, new.dtype, new.is_initialized = keys.device, keys.dtype, True
        new.bits, new.group, new.group_v, new.residual = bits, group, group_v, residual
        new.arithmetic = arithmetic  # the quantizer's rule: TailorKV's (fp32 math, fp16 scale/zero) or KIVI's
        new.seen_tokens, new.repeat, new.positions = layer.seen_tokens, layer.repeat, None
        n_kq, n_vq = n // residual * residual, max(n - residual, 0)
        new.k_quant = quantize(keys[:, :, :n_kq].mT, bits, group, arithmetic=arithmetic) if n_kq else None
        new.chunk_view = None  # set by `append_chunk` for the `decode_kv` of the chunk's own attention
        new.v_quant = quantize(values[:, :, :n_vq], bits, group_v, arithmetic=arithmetic) if n_vq else None
        new.keys, new.values = keys[:, :, n_kq:].clone(), values[:, :, n_vq:].clone()  # clone: slices pin storage
        return new

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Append one decode step `[B, H_kv, 1, D]`; returns the fp residuals. What the previous step's attention
        left over the windows is quantized first: the official step attends its token with the key block and the
        `residual + 1` values still in full precision and flushes afterwards (`TailorKVCache.quantize`), so a step
        never sees its own block or the value it pushes out quantized. Several tokens (a fed chunk) go to
        `append_chunk`."""
        if key_states.shape[-2] != 1:
            return self.append_chunk(key_states, value_states)
        if self.repeat > 1:
            key_states = key_states.repeat_interleave(self.repeat, dim=1)
            value_states = value_states.repeat_interleave(self.repeat, dim=1)
        self._settle()
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.seen_tokens += 1
        return self.keys, self.values

    def append_chunk(self, key_states: Tensor, value_states: Tensor) -> tuple[Tensor, Tensor]:
        """Append a fed chunk `[B, H_kv, q, D]` (query=agnostic's question, a later turn) as `q` decode steps would
        store it: every key block of `residual` the chunk fills is quantized but the newest (a step flushes its block
        only after attending it), values keep the last `residual + 1` tokens and quantize the older ones per token,
        so the storage equals that after `q` one-token updates. What the chunk attends (`decode_kv` with its `q`
        queries, right after) is kept aside: the past as its first token's step would see it (dequantized where
        quantized) and the chunk in full precision."""
        if self.repeat > 1:
            key_states = key_states.repeat_interleave(self.repeat, dim=1)
            value_states = value_states.repeat_interleave(self.repeat, dim=1)
        self._settle()
        quantized_keys = self.k_quant.length if self.k_quant is not None else 0
        quantized_values = self.v_quant.packed.shape[-2] if self.v_quant is not None else 0
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.chunk_view = (quantized_keys, quantized_values, self.keys, self.values)
        n_keys, n_values = self.keys.shape[-2], self.values.shape[-2]
        self._flush((n_keys - 1) % self.residual + 1, min(n_values, self.residual + 1))  # as the last step leaves it
        self.seen_tokens += key_states.shape[-2]
        return self.keys, self.values

    def _settle(self) -> None:
        """The flush a step does after attending: a full key block (`residual` fp keys) is quantized whole, and
        values beyond the last `residual` leave the window quantized."""
        self._flush(self.keys.shape[-2] % self.residual, min(self.values.shape[-2], self.residual))

    def _flush(self, keys_left: int, values_left: int) -> None:
        """Quantize all but the newest `keys_left` fp keys (whole blocks: blocks are whole groups, so quantizing
        several at once equals one by one) and all but the newest `values_left` fp values (per token)."""
        old_keys = self.keys.shape[-2] - keys_left
        if old_keys > 0:
            block = quantize(self.keys[:, :, :old_keys].mT, self.bits, self.group, arithmetic=self.arithmetic)
            self.k_quant = cat(self.k_quant, block, dim=-1)
            self.keys = self.keys[:, :, old_keys:].clone()
        old_values = self.values.shape[-2] - values_left
        if old_values > 0:
            block = quantize(self.values[:, :, :old_values], self.bits, self.group_v, arithmetic=self.arithmetic)
            self.v_quant = cat(self.v_quant, block, dim=-2)
            self.values = self.values[:, :, old_values:].clone()

    def decode_kv(self, query: Tensor | None = None) -> DecodeKV:
        """Every token's key and value, dequantized, fp32 `[B, H, T, D]`. Keys and values split quantized/residual
        at different tokens; each side is reassembled in token order (nothing is evicted: slot = position). Right
        after `append_chunk`, a chunk's queries `[B, H_q, q, D]` get the past as stored before it + the chunk in full
        precision (its last `q` entries; causal among them: the caller's)."""
        if query is not None and query.shape[2] > 1 and getattr(self, "chunk_view", None) is not None:
            return self._chunk_kv()
        keys, values = self.keys.float(), self.values.float()  # fp32 math
        if self.k_quant is not None:  # quantized keys are stored [B, H, D, T]
            keys = torch.cat([self.k_quant.dequantize().mT, keys], dim=-2)
        if self.v_quant is not None:
            values = torch.cat([self.v_quant.dequantize(), values], dim=-2)
        return DecodeKV(keys, values)

    def _chunk_kv(self) -> DecodeKV:
        """What a fed chunk attends (see `append_chunk`): as the official prefill attends its own tokens in full
        precision and quantizes after, the chunk sees itself unquantized; the past is what the step before it saw."""
        quantized_keys, quantized_values, keys, values = self.chunk_view
        self.chunk_view = None
        keys, values = keys.float(), values.float()
        if quantized_keys:  # (the blocks the chunk flushed come after: their tokens are in `keys` unquantized)
            keys = torch.cat([self.k_quant.dequantize().mT[:, :, :quantized_keys], keys], dim=-2)
        if quantized_values:
            values = torch.cat([self.v_quant.dequantize()[:, :, :quantized_values], values], dim=-2)
        return DecodeKV(keys, values)

    def keep(self, idx: Tensor) -> None:
        raise NotImplementedError("cache: a quantized layer keeps every token; eviction does not apply")

    # --- accounting -------------------------------------------------------------------------------------------
    def get_seq_length(self) -> int:
        return self.keys.shape[-2] + (self.k_quant.length if self.k_quant is not None else 0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0  # decode attention ignores masks (one token sees every entry)

    def nbytes(self) -> int:
        """Bytes held: packed codes and fp16 scales/zeros of K and V, plus the fp residuals."""
        quant = sum(q.nbytes() for q in (self.k_quant, self.v_quant) if q is not None)
        return quant + sum(t.numel() * t.element_size() for t in (self.keys, self.values))

    def entries_per_head(self) -> list[int]:
        return [self.get_seq_length()] * self.keys.shape[1]
