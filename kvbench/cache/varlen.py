"""Per-head variable-length cache layer (Ada-KV) and decode attention over it.

After an Ada-style selection each head keeps a different number of prompt entries. They are stored flattened,
head after head, in `flat_keys/flat_values` `[N, D]` with offsets `cu` `[H + 1]` (the layout of the official
`DynamicCacheSplitHeadFlatten`), so memory is exactly the kept entries, no padding. Tokens generated afterwards
arrive one per head per step, so they go to an ordinary dense part `keys/values` `[1, H, t, D]`: the flattened
prompt part is never copied again (the official CUDA kernel re-copies the whole layer every step).

Decode attention combines the two parts exactly with a log-sum-exp merge: flash-attn's varlen kernel for the
flattened part on CUDA in fp16/bf16 when flash-attn is importable (it supports nothing else), otherwise a per-head
loop of matmuls in fp32 (memory = one head's segment). Batch size 1. Sizes the kernel needs as Python ints (the
longest head, the offsets) are computed once at selection, so a decode step never waits on the device for them.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from kvbench.cache.kv_cache import KVLayer


class VarlenLayer(KVLayer):
    """Flattened per-head prompt entries + a dense part for decoded tokens. Built by `from_selection`."""

    is_varlen = True

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
        new.cu_int32 = new.cu.to(torch.int32)  # flash-attn's offset type, converted once
        new.offsets = new.cu.tolist()  # plain ints, host-side: the CPU loop and the longest head need no sync
        new.max_head_len = max(len(i) for i in idx)
        empty = layer.keys.new_empty(1, len(idx), 0, layer.keys.shape[-1])
        new.keys, new.values = empty, empty.clone()
        new.positions = layer.positions.new_empty(1, len(idx), 0)
        new.dtype, new.device, new.is_initialized = layer.keys.dtype, layer.keys.device, True
        new.seen_tokens, new.repeat = layer.seen_tokens, layer.repeat * rep
        return new

    def attend(self, query: Tensor, scaling: float) -> Tensor:
        """Decode attention of one token over this layer (the capture calls it instead of the model's kernel)."""
        return varlen_decode_attention(query, self, scaling)

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


def varlen_decode_attention(query: Tensor, layer: VarlenLayer, scaling: float) -> Tensor:
    """Attention of one new token over a `VarlenLayer`: query `[1, H_q, 1, D]` -> output `[1, 1, H_q, D]`
    (the layout transformers' attention functions return). Query head `h * G + g` reads stored head h."""
    if query.shape[0] != 1 or query.shape[2] != 1:
        raise NotImplementedError("varlen attention: batch size 1 and one query token only")
    n_heads, d = layer.head_lens.shape[0], query.shape[-1]
    q = query[0, :, 0].reshape(n_heads, -1, d)  # [H, G, D]
    if use_flash(query):
        out = _flash_decode(q, layer, scaling)
    else:
        out = _torch_decode(q, layer, scaling)
    return out.reshape(1, 1, -1, d).to(query.dtype)


def _torch_decode(q: Tensor, layer: VarlenLayer, scaling: float) -> Tensor:
    """Per stored head: logits over its segment and its decoded tokens, one softmax, two matmuls. Float32 math."""
    qf = q.float()
    flat_k, flat_v = layer.flat_keys.float(), layer.flat_values.float()  # no copy when the cache is fp32
    dense_k, dense_v = layer.keys[0].float(), layer.values[0].float()  # [H, t, D]
    out = torch.empty_like(qf)
    for h, (s, e) in enumerate(zip(layer.offsets, layer.offsets[1:])):
        logits = torch.cat([qf[h] @ flat_k[s:e].T, qf[h] @ dense_k[h].T], dim=-1) * scaling
        probs = logits.softmax(dim=-1)  # [G, len_h + t]: the logits, not the cache, are concatenated
        out[h] = probs[:, : e - s] @ flat_v[s:e] + probs[:, e - s:] @ dense_v[h]
    return out


def use_flash(query: Tensor) -> bool:
    """flash-attn's varlen kernel only for fp16/bf16 CUDA tensors (it raises on fp32 and has no CPU build)."""
    return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and _flash_varlen() is not None


@functools.cache
def _flash_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def _flash_decode(q: Tensor, layer: VarlenLayer, scaling: float) -> Tensor:
    """Each stored head is one 'sequence' of one query token carrying its G query heads, over a single KV head."""
    flash = _flash_varlen()
    n_heads, group, d = q.shape
    cu_q = torch.arange(n_heads + 1, device=q.device, dtype=torch.int32)
    out, lse, _ = flash(q.contiguous(), layer.flat_keys.view(-1, 1, d), layer.flat_values.view(-1, 1, d), cu_q,
                        layer.cu_int32, 1, layer.max_head_len, softmax_scale=scaling,
                        causal=False, return_attn_probs=True)
    lse = lse.view(group, n_heads).T.float()  # [H, G]
    if layer.keys.shape[-2] == 0:
        return out
    logits = torch.einsum("hgd,htd->hgt", q.float(), layer.keys[0].float()) * scaling
    lse_dense = logits.logsumexp(-1)
    out_dense = torch.einsum("hgt,htd->hgd", logits.softmax(-1), layer.values[0].float())
    total = torch.logaddexp(lse, lse_dense)
    return out.float() * (lse - total).exp()[..., None] + out_dense * (lse_dense - total).exp()[..., None]
