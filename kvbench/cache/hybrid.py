"""The recurrent state of a hybrid model's non-attention layers (linear attention, Gated DeltaNet, Mamba, short conv).

Hybrids (Qwen3.5 / Qwen3-Next, Jamba, Bamba, Falcon-H1, LFM2, Nemotron-H, Granite 4-H, OLMo-hybrid) call the cache's
`get_conv_state` / `update_conv_state` / `get_recurrent_state` / `update_recurrent_state` with their own layer
index. `RecurrentStates` answers them with transformers' own `LinearAttentionLayer` per such layer, so the state is
kept by transformers' update rules exactly (nothing of it is compressed). It lives beside the K/V layers, not among
them: `KVCache.layers` holds the attention layers only (a model layer's slot is its rank among them), so methods,
budgets, `kv_bytes` and the records count attention layers, and the state's bytes are reported on their own
(`state_bytes`): a constant per sequence, whatever the budget. Falcon-H1's layers have both (`hybrid`).
MiniMax's lightning (linear) attention keeps one `[B, H, D, D]` state per layer under `MiniMaxCache`'s own names
(`get_linear_cache` / `set_linear_cache`): it is held as that layer's recurrent state, so copies, beams and bytes treat
it as every other state.
"""
from __future__ import annotations

import copy

import torch
from torch import Tensor
from transformers.cache_utils import LinearAttentionLayer


class RecurrentStates:
    """{model layer index: transformers' `LinearAttentionLayer`}, created on a layer's first state update."""

    def __init__(self):
        self.layers: dict[int, LinearAttentionLayer] = {}

    def __bool__(self) -> bool:
        return bool(self.layers)

    def layer(self, layer_idx: int) -> LinearAttentionLayer:
        if layer_idx not in self.layers:
            self.layers[layer_idx] = LinearAttentionLayer()
        return self.layers[layer_idx]

    # --- what the model's layers call (the signatures of transformers' `Cache`) ---------------------------------
    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> Tensor | None:
        layer = self.layers.get(layer_idx)
        return layer.conv_states[state_idx] if layer is not None and layer.has_previous_state[state_idx] else None

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> Tensor | None:
        layer = self.layers.get(layer_idx)
        return layer.recurrent_states[state_idx] if layer is not None and layer.has_previous_state[state_idx] \
            else None

    def update_conv_state(self, conv_states: Tensor, layer_idx: int, state_idx: int = 0, **kwargs) -> Tensor:
        return self.layer(layer_idx).update_conv_state(conv_states, state_idx, **kwargs)

    def update_recurrent_state(self, recurrent_states: Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> Tensor:
        return self.layer(layer_idx).update_recurrent_state(recurrent_states, state_idx, **kwargs)

    def get_linear_state(self, layer_idx: int, state_idx: int = 0) -> Tensor | None:
        """MiniMax's lightning-attention state (`MiniMaxCache.get_linear_cache`): None until the layer's first write
        (it has no conv state, so transformers' `has_previous_state` never turns on for it)."""
        layer = self.layers.get(layer_idx)
        return layer.recurrent_states[state_idx] if layer is not None and \
            layer.is_recurrent_states_initialized[state_idx] else None

    def update_linear_state(self, linear_state: Tensor, layer_idx: int, state_idx: int = 0, **kwargs) -> Tensor:
        """MiniMax's `set_linear_cache`: the layer's new state replaces the old (copied in, as transformers' layer
        keeps its address)."""
        return self.layer(layer_idx).update_recurrent_state(linear_state, state_idx)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        if layer_idx is None:  # (transformers: the last linear layer)
            layer_idx = max(self.layers, default=None)
        layer = self.layers.get(layer_idx)
        if layer is None:
            return False
        return all(layer.has_previous_state.values()) if state_idx is None else layer.has_previous_state[state_idx]

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    # --- accounting and copies ------------------------------------------------------------------------------
    def tensors(self) -> list[Tensor]:
        return [t for layer in self.layers.values() for states in (layer.conv_states, layer.recurrent_states)
                for t in states.values() if t is not None]

    def nbytes(self) -> int:
        """Bytes of every conv and recurrent state held (constant per sequence once the prompt is in)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def clone(self) -> RecurrentStates:
        """An independent copy (a prefill that several configurations each continue, a snapshot to roll back to)."""
        twin = RecurrentStates()
        for i, layer in self.layers.items():
            copied = copy.copy(layer)
            copied.conv_states = {k: None if t is None else t.clone() for k, t in layer.conv_states.items()}
            copied.recurrent_states = {k: None if t is None else t.clone() for k, t in layer.recurrent_states.items()}
            copied.has_previous_state = dict(layer.has_previous_state)
            copied.is_conv_states_initialized = dict(layer.is_conv_states_initialized)
            copied.is_recurrent_states_initialized = dict(layer.is_recurrent_states_initialized)
            twin.layers[i] = copied
        return twin

    def reorder(self, beam_idx: Tensor) -> None:
        """Rows `beam_idx` of every state (beam search keeps each beam's state with its cache rows)."""
        for layer in self.layers.values():
            layer.reorder_cache(beam_idx)


def batched(states: list[Tensor | None]) -> Tensor | None:
    """Several sequences' states as one batch `[N, ...]` (None if any has none yet)."""
    return None if any(s is None for s in states) else torch.cat(states, dim=0)
