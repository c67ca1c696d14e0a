"""MPT attention routed through the capture's attention function, with ALiBi over each key's recorded position.

transformers' `MptAttention` computes its scores itself (no `AttentionInterface`) and adds ALiBi by cache *slot*:
`slope_h * (slot_k - last_slot)`. After eviction slots are no longer positions, so the capture replaces `forward` on
each MPT attention instance (never on the class) with `mpt_attention_forward`, which forms q/k/v exactly as MPT does
and biases each kept key by its ORIGINAL distance, `slope_h * (pos_k - pos_q)`, read from the cache layer's
`positions` (Keyformer's "Org Pos"). With `positions=shift` the layer reports its slots instead
(`KVLayer.attention_positions`), so the same code gives ALiBi over slots ("New Pos"). Softmax ignores a per-row
constant, so on an uncompressed cache this equals transformers' MPT exactly. The bias goes to the attention function as an additive float mask, to the capture's
scoring as `score_bias(rows)` so that methods score the attention the model really pays, and as `alibi_slopes` to
decode attention over layers with their own storage (Ada-KV, TailorKV), which reads each entry's position itself.
"""
from __future__ import annotations

import torch
from torch import Tensor


def alibi_slopes(n_heads: int, device=None) -> Tensor:
    """MPT's per-head slopes `[H]`, read from transformers' own ALiBi builder (as `MptModel` calls it)."""
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    return -build_mpt_alibi_tensor(n_heads, 2, device=device)[:, 0, 0]  # [H, 1, 2]: (-slope, 0)


def alibi_bias(slopes: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """`slope_h * (k_pos - q_pos)`, -inf where the key lies after the query: `[B, H, q, k]`, fp32.
    q_pos `[B, H, q]` and k_pos `[B, H, k]` are original token positions (per head: kept sets may differ)."""
    distance = (k_pos[:, :, None, :] - q_pos[:, :, :, None]).float()
    bias = distance * slopes.float()[None, :, None, None]
    return bias.masked_fill(distance > 0, float("-inf"))


def key_positions(past_key_values, layer_idx: int, n_keys: int, n_heads: int, device) -> Tensor:
    """The recorded position of every cached key `[B, H, k]` (a plain cache: slot = position)."""
    layer = past_key_values.layers[layer_idx] if past_key_values is not None else None
    positions = layer.attention_positions() if hasattr(layer, "attention_positions") else None  # slots: shift
    if positions is not None and positions.shape[-1] == n_keys:
        return positions.expand(-1, n_heads, -1) if positions.shape[1] == 1 else positions
    return torch.arange(n_keys, device=device).expand(1, n_heads, n_keys)


def attend_with_alibi(module, attention_fn, query: Tensor, key: Tensor, value: Tensor, cache, t: int,
                      slopes: Tensor, scaling: float):
    """The capture's attention with ALiBi by each kept key's recorded position (MPT's and BLOOM's forwards): the
    bias as the mask, and per row for scorers (`score_bias`) and the engine's own decode attention (`alibi_slopes`)."""
    k_pos = key_positions(cache, module.layer_idx, key.shape[2], key.shape[1], key.device)
    q_pos = k_pos[..., -t:]
    mask = alibi_bias(slopes, q_pos, k_pos).to(query.dtype)
    return attention_fn(module, query, key, value, mask, scaling=scaling,
                        score_bias=lambda rows: alibi_bias(slopes, q_pos[:, :, rows], k_pos), alibi_slopes=slopes)


def mpt_attention_forward(module, attention_fn):
    """A bound `forward` for one `MptAttention` instance that calls `attention_fn` (the capture's wrapper)."""

    def forward(hidden_states: Tensor, position_bias: Tensor | None = None, past_key_values=None,
                attention_mask: Tensor | None = None, **kwargs):
        b, t = hidden_states.shape[:2]
        qkv = module.Wqkv(hidden_states)
        if module.clip_qkv:
            qkv = qkv.clamp(min=-module.clip_qkv, max=module.clip_qkv)
        query, key, value = (x.reshape(b, t, module.n_heads, module.head_dim).transpose(1, 2) for x in qkv.chunk(3, 2))
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, module.layer_idx)
        out, weights = attend_with_alibi(module, attention_fn, query, key, value, past_key_values, t,
                                         alibi_slopes(module.n_heads, key.device), module.softmax_scale)
        return module.out_proj(out.reshape(b, t, -1)), weights

    return forward


def bloom_attention_forward(module, attention_fn):
    """A bound `forward` for one `BloomAttention` instance, as `mpt_attention_forward` for MPT. BLOOM adds
    `slope_h * slot_k` (its model-level `alibi` tensor, built from the mask by cache slot), which differs from
    `slope_h * (pos_k - pos_q)` by a per-row constant on an uncompressed cache; this forward uses each kept key's
    recorded position instead, and BLOOM's own slopes. The rest is BLOOM's: the per-head fused QKV split, the
    `1/sqrt(d)` scale, `dense` and the residual added by `dropout_add`."""
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes, dropout_add

    def forward(hidden_states: Tensor, residual: Tensor, alibi: Tensor | None = None,
                attention_mask: Tensor | None = None, layer_past=None, **kwargs):
        b, t = hidden_states.shape[:2]
        query, key, value = module._reshape(module.query_key_value(hidden_states))
        if layer_past is not None:
            key, value = layer_past.update(key, value, module.layer_idx)
        out, weights = attend_with_alibi(module, attention_fn, query, key, value, layer_past, t,
                                         _get_alibi_slopes(module.num_heads, key.device), module.inv_norm_factor)
        out = module.dense(out.reshape(b, t, -1))
        return dropout_add(out, residual, module.hidden_dropout, module.training), weights

    return forward
