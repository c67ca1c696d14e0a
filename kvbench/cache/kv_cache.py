"""A transformers `Cache` whose layers can drop entries for real and say what they hold.

Each `KVLayer` stores keys/values as `[B, H, T, D]` plus the original position of every entry, `[B, H, T]`.
`keep(idx)` gathers the surviving entries into new tensors; the old ones are released, so the bytes reported by
`nbytes()` are the bytes actually held. `H` is the model's KV heads, or its query heads when a method selects per
query head (the paper-era `query_head` layout of PyramidKV/SnapKV code): the first `keep` with more heads than stored
expands the layer, and later appended tokens are repeated to match.

Per-head variable lengths (Ada-KV) subclass `KVLayer` with flattened storage and per-head offsets; quantized and
offloaded layers (TailorKV) hold their own storage too. Every layer says what its next token attends as a
`DecodeKV` (`decode_kv`), and one function attends those of all sequences of a layer
(`kvbench.attention.decode.decode_attention`), so no caller tests types. Decode-time eviction calls
`keep` again after any step; positions stay the original ones, so RoPE is never re-derived from cache length.
Under pos-shift (`shift_inv_freq` set) the stored keys stay as computed and `update` returns them rotated to their
cache slots (`kvbench.cache.rerotate.shifted_keys`), exactly, from the originals.

Hybrid models (linear attention / SSM / conv layers beside attention): `layers` holds the attention layers only, in
model order (`slot_of`: model layer index -> slot, found as the model first writes each layer), and the other
layers' state sits in `states` (`kvbench.cache.hybrid`), kept by transformers' own rules.
"""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicLayer

from kvbench.cache.hybrid import RecurrentStates
from kvbench.cache.rerotate import shifted_keys, slot_targets


@dataclass
class DecodeKV:
    """What one decode step of a layer attends, per row (sequence) and stored head: keys/values `[B, H, L, D]`,
    `valid` `[B, H, L]` (None: every entry; per-head variable layers pad their heads) and `positions` `[B, H, L]` as
    attention sees them (ALiBi and windows read them; None: slot = position). The newest entry, the query's own
    token, is the last one of each row."""

    keys: Tensor
    values: Tensor
    valid: Tensor | None = None
    positions: Tensor | None = None


def row_index(idx: Tensor, n: int) -> Tensor:
    """Indices `idx` `[B, H, k]` into each (batch, head)'s `n` rows, as indices into all `B * H * n` rows `[B*H*k]`."""
    return (idx + _first_rows(*idx.shape[:2], n, idx.device)).view(-1)


@functools.lru_cache(maxsize=256)
def _first_rows(b: int, h: int, n: int, device: torch.device) -> Tensor:
    """Where each (batch, head)'s rows start among `B * H * n`, `[B, H, 1]` (made once per shape: a decode step asks
    for the same few shapes at every layer)."""
    return torch.arange(0, b * h * n, n, device=device).view(b, h, 1)


def gather_rows(source: Tensor, idx: Tensor, flat: Tensor | None = None) -> Tensor:
    """Rows `idx` `[B, H, k]` of `source` `[B, H, n, D]`, per (batch, head): a new `[B, H, k, D]` tensor. One
    `index_select` over the flattened rows copies whole rows; `gather` with the index expanded over D indexes every
    element and is 2-4x slower on the CPU at a decode step's sizes. `flat`: `row_index(idx, n)` when already made."""
    b, h, n, d = source.shape
    flat = row_index(idx, n) if flat is None else flat
    return source.reshape(b * h * n, d).index_select(0, flat).view(b, h, idx.shape[-1], d)


class KVLayer(DynamicLayer):
    """One layer's cache: keys/values `[B, H, T, D]`, positions `[B, H, T]` (original token positions)."""

    is_varlen = False
    own_storage = False  # True: not a dense `[B, H, T, D]` layer (per-head variable, quantized, offloaded); such a
    # layer is attended only through `decode_kv` and cannot be reordered, cloned or moved into shared rows

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.positions: Tensor | None = None
        self.seen_tokens = 0  # logical length: every token ever appended, kept or not
        self.repeat = 1  # >1 once the layer holds one copy per query head
        self.next_position: int | None = None  # set for position shift: where the next appended token sits
        self.shift_inv_freq: Tensor | None = None  # set for position shift: attention sees keys at cache slots
        self.indexer_keys: Tensor | None = None  # DSA models (DeepSeek-V3.2): the sparse-attention indexer's key
        # per entry `[B, T, D_index]`, kept and evicted with the entries (the latent's one head)

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Append new entries `[B, H_kv, q_len, D]` and return the whole layer (what attention reads)."""
        q_len = key_states.shape[-2]
        if self.repeat > 1:
            key_states = key_states.repeat_interleave(self.repeat, dim=1)
            value_states = value_states.repeat_interleave(self.repeat, dim=1)
        b, h = key_states.shape[:2]
        first = self.seen_tokens if self.next_position is None else self.next_position
        self.next_position = None
        pos = torch.arange(first, first + q_len, device=key_states.device)
        pos = pos.expand(b, h, q_len)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values, self.positions = key_states, value_states, pos.clone()
        else:
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
            self.positions = torch.cat([self.positions, pos], dim=-1)
        self.seen_tokens += q_len
        if self.shift_inv_freq is not None:  # pos-shift: rotated from the stored originals, never rewritten
            return shifted_keys(self.keys, self.positions, self.shift_inv_freq), self.values
        return self.keys, self.values

    def update_indexer(self, indexer_keys: Tensor) -> Tensor:
        """Append a DSA indexer's keys `[B, q_len, D_index]` (transformers' `DynamicIndexedLayer` API) and return
        every entry's; they follow the entries through `keep` and `truncate`."""
        held = self.indexer_keys
        self.indexer_keys = indexer_keys if held is None else torch.cat([held, indexer_keys], dim=1)
        return self.indexer_keys

    def attention_positions(self) -> Tensor:
        """Positions as attention sees the keys `[B, H, T]`: the recorded ones, or their slots under pos-shift
        (ALiBi reads these for its bias)."""
        return slot_targets(self.positions) if self.shift_inv_freq is not None else self.positions

    def decode_kv(self, query: Tensor | None = None) -> DecodeKV:
        """What the next token attends (already appended by `update`): the keys as attention sees them (rotated to
        their slots under pos-shift). `query` `[B, H_q, 1, D]` matters only to layers that retrieve by it."""
        keys = self.keys if self.shift_inv_freq is None else shifted_keys(self.keys, self.positions,
                                                                         self.shift_inv_freq)
        return DecodeKV(keys, self.values, None, self.attention_positions())

    @staticmethod
    def decode_kv_many(layers: list[KVLayer], query: Tensor) -> list[DecodeKV]:
        """`decode_kv` of several sequences' layers of one type, row i of `query` `[S, H_q, 1, D]` for `layers[i]`
        (batched decoding asks once per layer and type); a type overrides it where one call for all is cheaper."""
        return [layer.decode_kv(query[i:i + 1]) for i, layer in enumerate(layers)]

    def keep(self, idx: Tensor) -> None:
        """Keep only entries `idx` `[B, H_sel, k]` (indices into the current entries); free the rest.

        `H_sel` is the stored head count, or a multiple of it to switch to one copy per query head.
        """
        b, h_sel, _ = idx.shape
        h_store = self.keys.shape[1]
        if h_sel % h_store:
            raise ValueError(f"cache: cannot select {h_sel} heads from a layer holding {h_store}")
        rep = h_sel // h_store
        if rep == 1:  # (whole rows copied: the same copy as the indexing below, fewer ops per decode step)
            flat = row_index(idx, self.keys.shape[-2])
            self.keys = gather_rows(self.keys, idx, flat)
            self.values = gather_rows(self.values, idx, flat)
            self.positions = self.positions.gather(2, idx)
            self._keep_indexer(idx)
            return
        batch = torch.arange(b, device=idx.device)[:, None, None]
        head = (torch.arange(h_sel, device=idx.device) // rep)[None, :, None]
        self.keys = self.keys[batch, head, idx].contiguous()  # advanced indexing copies: old storage is released
        self.values = self.values[batch, head, idx].contiguous()
        self.positions = self.positions[batch, head, idx].contiguous()
        self.repeat *= rep
        self._keep_indexer(idx)

    def _keep_indexer(self, idx: Tensor) -> None:
        """The indexer keys of the kept entries (a DSA layer holds one latent head: `idx[:, 0]`)."""
        if self.indexer_keys is not None:
            rows = idx[:, 0, :, None].expand(-1, -1, self.indexer_keys.shape[-1])
            self.indexer_keys = self.indexer_keys.gather(1, rows)

    def truncate(self, max_length: int) -> None:
        """Keep the first `max_length` entries (slot order) and forget the rest, as if they were never appended:
        a continuation prefill whose K/V is only scored (KVzip's reconstruction) is dropped this way."""
        if not self.is_initialized or max_length >= self.keys.shape[-2]:
            return
        self.keys = self.keys[:, :, :max_length].contiguous()  # a copy: the longer storage is released
        self.values = self.values[:, :, :max_length].contiguous()
        self.positions = self.positions[..., :max_length].contiguous()
        if self.indexer_keys is not None:
            self.indexer_keys = self.indexer_keys[:, :max_length].contiguous()
        self.seen_tokens = max_length

    def clone(self) -> "KVLayer":
        """An independent copy (tensors copied): a prefilled layer that several methods each compress (grid sweeps)."""
        twin = copy.copy(self)
        if self.is_initialized:
            twin.keys, twin.values, twin.positions = self.keys.clone(), self.values.clone(), self.positions.clone()
            if self.indexer_keys is not None:
                twin.indexer_keys = self.indexer_keys.clone()
        return twin

    # --- accounting -------------------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes of K and V physically held, a DSA indexer's keys included (positions are bookkeeping and reported
        separately)."""
        if not self.is_initialized:
            return 0
        indexer = 0 if self.indexer_keys is None else self.indexer_keys.numel() * self.indexer_keys.element_size()
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size() + indexer

    def host_nbytes(self) -> int:
        """Bytes this layer keeps in host memory (offloading layers); 0 for a device-resident layer."""
        return 0

    def entries_per_head(self) -> list[int]:
        """Logical entries kept per stored head (batch element 0)."""
        if not self.is_initialized:
            return []
        return [self.keys.shape[-2]] * self.keys.shape[1]


class KVCache(Cache):
    """A list of `KVLayer`s, one per attention layer (created lazily on first update), and the recurrent state of a
    hybrid model's other layers (`states`)."""

    def __init__(self):
        super().__init__(layer_class_to_replicate=KVLayer)
        self.peak_nbytes = 0  # the most K/V bytes held at once so far (`note_peak`)
        self.decode_steps = 0  # decode steps seen (`note_step`): their bytes' peak and sum, for the record
        self.decode_peak_nbytes = 0
        self.decode_sum_nbytes = 0
        self.ranked: dict[int, Tensor] = {}  # layer -> positions its last selection ranked best first, for a method
        # that `holds_ranked` (R-KV's reference stores its kept entries in that order)
        self.slot_of: dict[int, int] = {}  # model layer index -> its slot in `layers` (identity without hybrids)
        self.states = RecurrentStates()  # linear attention / SSM / conv layers' state (hybrid models)

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        layer_idx = self.slot_of.setdefault(layer_idx, len(self.slot_of))
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if key_states.shape[-2] > 1:  # each prefill layer
            self.note_peak()
        elif layer_idx == len(self.layers) - 1:  # each decode step, once every layer holds its token
            self.note_step()
        return out

    def note_step(self) -> None:
        """One decode step's bytes: the peak so far, and the peak and mean over decoding (what a long generation
        under decode-time compression holds, `kv_bytes_peak` / `kv_bytes_mean` in the record)."""
        held = self.nbytes()
        self.peak_nbytes = max(self.peak_nbytes, held)
        self.decode_steps += 1
        self.decode_peak_nbytes = max(self.decode_peak_nbytes, held)
        self.decode_sum_nbytes += held

    def note_peak(self, extra: int = 0) -> None:
        """Sample the bytes held (+ `extra` held transiently, e.g. a layer's old and new tensors during a gather)."""
        self.peak_nbytes = max(self.peak_nbytes, self.nbytes() + extra)

    def clone(self) -> "KVCache":
        """A copy whose tensors are independent of this cache's (every layer must be a plain `KVLayer`)."""
        if any(type(layer) is not KVLayer for layer in self.layers):
            raise ValueError("cache: only an uncompressed (prefilled) cache can be cloned")
        twin = copy.copy(self)
        twin.layers, twin.ranked = [layer.clone() for layer in self.layers], dict(self.ranked)
        twin.slot_of, twin.states = dict(self.slot_of), self.states.clone()
        return twin

    # --- hybrid models: the non-attention layers' state (transformers' `Cache` API, by model layer index) --------
    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> Tensor | None:
        return self.states.get_conv_state(layer_idx, state_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> Tensor | None:
        return self.states.get_recurrent_state(layer_idx, state_idx)

    def update_conv_state(self, conv_states: Tensor, layer_idx: int, state_idx: int = 0, **kwargs) -> Tensor:
        return self.states.update_conv_state(conv_states, layer_idx, state_idx, **kwargs)

    def update_recurrent_state(self, recurrent_states: Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        return self.states.update_recurrent_state(recurrent_states, layer_idx, state_idx, **kwargs)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return self.states.has_previous_state(layer_idx, state_idx)

    def get_linear_cache(self, layer_idx: int) -> Tensor | None:  # (MiniMax's lightning attention: `MiniMaxCache`)
        return self.states.get_linear_state(layer_idx)

    def set_linear_cache(self, layer_idx: int, linear_cache: Tensor) -> None:
        self.states.update_linear_state(linear_cache, layer_idx)

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def state_nbytes(self) -> int:
        """Bytes of the recurrent state (hybrid models; 0 otherwise): constant memory, not counted in `nbytes`."""
        return self.states.nbytes()

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def host_nbytes(self) -> int:
        return sum(layer.host_nbytes() for layer in self.layers)

    def entries_per_head(self) -> list[list[int]]:
        return [layer.entries_per_head() for layer in self.layers]

    def entries_per_layer(self) -> list[float]:
        """Mean entries per head, per layer (the quantity budgets are stated in)."""
        return [sum(e) / len(e) if e else 0.0 for e in self.entries_per_head()]
