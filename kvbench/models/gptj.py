"""GPT-J attention routed through the capture's attention function.

transformers' `GPTJAttention.forward` forms post-rotary queries and keys itself (interleaved rotary on the first
`rotary_dim` dims), updates the cache, and then calls its own `_attn(query, key, value, attention_mask)` instead of
`AttentionInterface`. The capture replaces `_attn` on each instance (never on the class) with `gptj_attention_core`,
so everything before it stays transformers' own code and the capture sees exactly the q/k it computed.
"""
from __future__ import annotations

from torch import Tensor


def gptj_attention_core(module, attention_fn):
    """A bound `_attn` for one `GPTJAttention` instance: `[B, H, q, D]` in and out, like the original."""

    def _attn(query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None = None):
        out, weights = attention_fn(module, query, key, value, attention_mask, scaling=1.0 / module.scale_attn)
        return out.transpose(1, 2), weights  # attention functions return [B, q, H, D]

    return _attn
