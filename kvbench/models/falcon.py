"""Falcon (rotary) attention routed through the capture's attention function.

transformers' `FalconAttention.forward` computes attention inline (its own sdpa call or eager matmuls), not through
`AttentionInterface`. The capture replaces `forward` on each instance (never on the class) with
`falcon_attention_forward`, which forms q/k/v with the module's own fused projection and `_split_heads` (multi-query,
grouped "new decoder architecture" and multi-head layouts alike), rotates them with transformers' Falcon
`apply_rotary_pos_emb`, updates the cache, and hands them to the capture's function. ALiBi Falcon (falcon-rw) is
refused before weights load (`config.alibi`).
"""
from __future__ import annotations

from types import SimpleNamespace

from torch import Tensor


def falcon_query(module, hidden: Tensor) -> Tensor:
    """The module's queries for `hidden` `[B, q, hidden]`, before rotary: `[B, H_q, q, D]` (its own split)."""
    return module._split_heads(module.query_key_value(hidden))[0].transpose(1, 2)


def falcon_attention_forward(module, attention_fn):
    """A bound `forward` for one `FalconAttention` instance that calls `attention_fn` (the capture's wrapper)."""
    from transformers.models.falcon.modeling_falcon import apply_rotary_pos_emb

    def forward(hidden_states: Tensor, alibi: Tensor | None = None, attention_mask: Tensor | None = None,
                position_ids=None, layer_past=None, use_cache: bool = False, output_attentions: bool = False,
                position_embeddings: tuple[Tensor, Tensor] | None = None, **kwargs):
        if alibi is not None:
            raise NotImplementedError("falcon: ALiBi Falcon is not supported")
        b, t = hidden_states.shape[:2]
        query, key, value = module._split_heads(module.query_key_value(hidden_states))
        n_kv = module.num_heads if module.new_decoder_architecture else module.num_kv_heads
        query = query.transpose(1, 2).reshape(b, module.num_heads, t, module.head_dim)
        key = key.transpose(1, 2).reshape(b, n_kv, t, module.head_dim)
        value = value.transpose(1, 2).reshape(b, n_kv, t, module.head_dim)
        query, key = apply_rotary_pos_emb(query, key, *position_embeddings)
        if layer_past is not None:
            key, value = layer_past.update(key, value, module.layer_idx)
        view = SimpleNamespace(layer_idx=module.layer_idx, num_key_value_groups=module.num_heads // key.shape[1],
                               is_causal=True, scaling=module.inv_norm_factor, training=module.training)
        out, weights = attention_fn(view, query, key, value, attention_mask, scaling=module.inv_norm_factor)
        return module.dense(out.reshape(b, t, -1)), weights

    return forward
