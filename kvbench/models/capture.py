"""Per-model-instance attention capture, as a context manager.

`with AttentionCapture(model, window=32) as capture:` registers a uniquely named attention function that wraps the
model's own implementation (sdpa or eager), points *this* model at it, and restores the model on exit. Nothing global
is patched: another model in the same process keeps its attention untouched.

What it records at prefill, per layer: the last `window` post-RoPE queries `[B, H_q, w, D]` and the softmax scale.
That is all SnapKV-style scoring needs, so the n x n attention matrix is never built. Decode-time policies (H2O,
Keyformer) get `on_decode(layer_idx, query, key)` callbacks through `decode_hook`.

The wrapper also lets a layer hold one KV copy per query head (the paper-era `query_head` layout): the wrapped
function then sees as many key heads as query heads and is told not to repeat them.
"""
from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Callable

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

from kvbench.cache.varlen import varlen_decode_attention

_ids = itertools.count()


class AttentionCapture:
    """Records window queries at prefill for one model instance; see the module docstring."""

    def __init__(self, model: torch.nn.Module, window: int = 0,
                 decode_hook: Callable[[int, Tensor, Tensor], None] | None = None):
        self.model = model
        self.window = window
        self.decode_hook = decode_hook
        self.window_queries: dict[int, Tensor] = {}
        self.scaling: dict[int, float] = {}
        self.cache = None  # set by `generation.compress`: lets decode attention find per-head variable layers
        self.name = f"kvbench_capture_{next(_ids)}"
        self._original: str | None = None

    def reset(self) -> None:
        """Forget what the previous prompt left behind (call between samples)."""
        self.window_queries.clear()
        self.scaling.clear()
        self.cache = None

    # --- context manager --------------------------------------------------------------------------------------
    def __enter__(self) -> "AttentionCapture":
        self._original = self.model.config._attn_implementation
        inner = ALL_ATTENTION_FUNCTIONS.get_interface(self._original, eager_attention_forward)
        AttentionInterface.register(self.name, self._wrap(inner))
        mask_fn = ALL_MASK_ATTENTION_FUNCTIONS.get(self._original, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
        AttentionMaskInterface.register(self.name, mask_fn)
        self.model.set_attn_implementation(self.name)
        return self

    def __exit__(self, *exc) -> None:
        self.model.set_attn_implementation(self._original)
        AttentionInterface._global_mapping.pop(self.name, None)
        AttentionMaskInterface._global_mapping.pop(self.name, None)
        self.reset()

    # --- the attention function -------------------------------------------------------------------------------
    def _wrap(self, inner: Callable) -> Callable:
        def attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, **kwargs):
            layer_idx = module.layer_idx
            q_len = query.shape[2]
            if q_len > 1 and self.window:  # prefill: keep only what window scoring needs
                self.window_queries[layer_idx] = query[:, :, -self.window:].detach().clone()
                self.scaling[layer_idx] = kwargs.get("scaling") or module.scaling
            elif q_len == 1 and self.decode_hook is not None:
                self.decode_hook(layer_idx, query, key)
            if q_len == 1:
                layer = self.cache.layers[layer_idx] if self.cache is not None else None
                if getattr(layer, "is_varlen", False):
                    scaling = kwargs.get("scaling") or module.scaling
                    return varlen_decode_attention(query, layer, scaling), None
                if attention_mask is not None and attention_mask.shape[-1] != key.shape[-2]:
                    attention_mask = None  # layers keep different lengths; one token at batch 1 sees all of its layer
            if key.shape[1] == query.shape[1] and getattr(module, "num_key_value_groups", 1) > 1:
                # the cache already holds one copy per query head: tell the kernel not to repeat
                module = SimpleNamespace(num_key_value_groups=1, is_causal=getattr(module, "is_causal", True),
                                         layer_idx=layer_idx, scaling=module.scaling, training=module.training)
            return inner(module, query, key, value, attention_mask, **kwargs)

        return attention
