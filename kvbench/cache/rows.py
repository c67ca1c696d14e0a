"""Rows: one layer of several decoding samples in one buffer, so batched decoding attends them in one call.

Kept as separate tensors, each sample's layer is copied whole on every decode step (`torch.cat` appends one token)
and attended one sample at a time. Here row r of `[R, H, capacity, D]` buffers holds one sample's layer: its kept
entries, then each decoded token written in place, and one attention call reads every row, masked to each row's
length. The sample's `RowLayer` is a view of its row, so its accounting (`nbytes`, entries per head) is what its
own tensors would give; the rows' spare capacity (at most the tokens still to decode, rounded up to `ROUND`) is not
counted per sample. Only plain dense layers move into rows (`kvbench.engine.batching` decides): no decode-time eviction,
no per-sample attention temperature, no position shift, no sliding window; the decoded tokens of per-head variable
layers do too, beside their pool (`kvbench.cache.varlen.VarlenRows`).
"""
from __future__ import annotations

import torch
from torch import Tensor

from kvbench.cache.kv_cache import KVLayer

ROUND = 64  # row capacities are rounded up to this many entries, so samples of one budget share a buffer


class Rows:
    """`keys`/`values` `[R, H, capacity, D]` and `positions` `[R, H, capacity]`; `lengths[r]` entries of row r are
    held by `owners[r]` (None: a free row). Grows by one row when a sample joins and none is free."""

    def __init__(self, like: KVLayer, capacity: int):
        self.capacity = capacity
        self.keys = like.keys.new_zeros(0, like.keys.shape[1], capacity, like.keys.shape[-1])
        self.values = like.values.new_zeros(0, like.values.shape[1], capacity, like.values.shape[-1])
        self.positions = like.positions.new_zeros(0, like.positions.shape[1], capacity)
        self.held = torch.zeros(0, capacity, dtype=torch.bool, device=like.keys.device)  # entries a row holds
        self.lengths: list[int] = []
        self.owners: list[RowLayer | None] = []
        self.pool = None  # the `varlen.VarlenRows` whose decoded tokens these rows hold, if any

    @staticmethod
    def capacity_for(layer: KVLayer, new_tokens: int, bound: int | None = None) -> int:
        """Room for the layer and every token still to decode, or for `bound` entries (a layer compressed again
        while decoding never holds more), rounded up to `ROUND`."""
        most = layer.keys.shape[-2] + new_tokens if bound is None else bound
        return -(-most // ROUND) * ROUND

    def take(self, layer: KVLayer) -> RowLayer:
        """Move a batch-1 layer `[1, H, n, D]` into a free row; returns the layer that now stands for it."""
        if None not in self.owners:
            self._grow()
        row = self.owners.index(None)
        n = layer.keys.shape[-2]
        self.keys[row, :, :n] = layer.keys[0]
        self.values[row, :, :n] = layer.values[0]
        self.positions[row, :, :n] = layer.positions[0]
        self.held[row, :n] = True
        self.lengths[row] = n
        owner = self.owners[row] = RowLayer.of(layer, self, row)
        return owner

    def release(self, row: int) -> None:
        self.owners[row], self.lengths[row] = None, 0
        self.held[row] = False

    def _grow(self) -> None:
        """One more row (the owners' views are made from the buffers when read)."""
        self.keys, self.values, self.positions, self.held = (
            torch.cat([t, t.new_zeros(1, *t.shape[1:])]) for t in (self.keys, self.values, self.positions, self.held))
        self.lengths.append(0)
        self.owners.append(None)

    def attention_inputs(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """Every row's keys and values up to the longest row, and the additive mask `[R, 1, 1, longest]` that hides
        what a row does not hold (None when every row holds as many). A free row shows its first slot."""
        longest = max(max(self.lengths), 1)
        keys, values = self.keys[:, :, :longest], self.values[:, :, :longest]
        if min(self.lengths) == longest:
            return keys, values, None
        held = self.held[:, :longest].clone()
        held[:, 0] = True  # a free row attends its first slot (its output is not used), never nothing
        mask = torch.zeros(held.shape, dtype=keys.dtype, device=keys.device)
        return keys, values, mask.masked_fill_(~held, torch.finfo(keys.dtype).min)[:, None, None]


class RowLayer(KVLayer):
    """A sample's layer held in row `row` of `rows`: `keys`, `values` and `positions` are views of that row."""

    rows: Rows
    row: int

    @classmethod
    def of(cls, layer: KVLayer, rows: Rows, row: int) -> RowLayer:
        new = cls.__new__(cls)
        new.__dict__.update({k: v for k, v in layer.__dict__.items() if k not in ("keys", "values", "positions")})
        new.rows, new.row = rows, row
        return new

    # views of the row, made when read (decoding reads them rarely: bytes come from the row's length)
    @property
    def keys(self) -> Tensor:
        return self.rows.keys[self.row:self.row + 1, :, :self.rows.lengths[self.row]]

    @property
    def values(self) -> Tensor:
        return self.rows.values[self.row:self.row + 1, :, :self.rows.lengths[self.row]]

    @property
    def positions(self) -> Tensor:
        return self.rows.positions[self.row:self.row + 1, :, :self.rows.lengths[self.row]]

    def nbytes(self) -> int:
        keys, values = self.rows.keys, self.rows.values
        per_entry = keys.shape[1] * (keys.shape[-1] * keys.element_size() + values.shape[-1] * values.element_size())
        return self.rows.lengths[self.row] * per_entry

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Write one new token `[1, H_kv, 1, D]` in place at the end of the row."""
        append([self], [key_states[0]], [value_states[0]])
        return self.keys, self.values

    def keep(self, idx: Tensor) -> None:
        """Keep entries `idx` `[1, H, k]` (sorted, the same count per head), compacted in place at the row's start:
        a row's capacity never changes (decode-time compression, kvbench.engine.recompress, brings the row back
        to its target every few steps; the freed slots take the next tokens)."""
        rows, r, k = self.rows, self.row, idx.shape[-1]
        if idx.shape[0] != 1 or idx.shape[1] != rows.keys.shape[1]:
            raise ValueError(f"cache: a row keeps [1, {rows.keys.shape[1]}, k] indices, not {list(idx.shape)}")
        n = rows.lengths[r]
        for buffer in (rows.keys, rows.values):
            part = buffer[r, :, :n]
            part[:, :k] = part.gather(1, idx[0, :, :, None].expand(-1, -1, part.shape[-1]))
        part = rows.positions[r, :, :n]
        part[:, :k] = part.gather(1, idx[0])
        rows.held[r, k:n] = False
        rows.lengths[r] = k

    def release(self) -> None:
        """The sample has left the batch: its row is free for the next one (this layer must not be used again)."""
        self.rows.release(self.row)

    def detach(self) -> KVLayer:
        """The sample has left the batch but its cache lives on (a conversation's next turn is fed on it): a plain
        layer holding a copy of the row, and the row freed."""
        layer = KVLayer.__new__(KVLayer)
        layer.__dict__.update({k: v for k, v in self.__dict__.items() if k not in ("rows", "row")})
        layer.keys, layer.values, layer.positions = self.keys.clone(), self.values.clone(), self.positions.clone()
        self.release()
        return layer


def append(layers: list[RowLayer], key_states: list[Tensor], value_states: list[Tensor]) -> None:
    """One decoded token per layer (`key_states[j]` `[H_kv, 1, D]` for `layers[j]`), written in place at the end
    of each one's row. Indices stay on the host (slice writes): no host-to-device copy, so no stream sync on CUDA."""
    for layer, keys, values in zip(layers, key_states, value_states):
        if keys.shape[-2] != 1 or layer.shift_inv_freq is not None:
            raise NotImplementedError("cache: a row layer appends one decoded token at a time, without pos-shift")
        if layer.repeat > 1:
            keys, values = keys.repeat_interleave(layer.repeat, dim=0), values.repeat_interleave(layer.repeat, dim=0)
        rows, r = layer.rows, layer.row
        n = rows.lengths[r]
        if n == rows.capacity:
            raise RuntimeError(f"cache: row {r} is full ({n} entries); it was sized for fewer new tokens")
        rows.keys[r, :, n] = keys[:, 0]
        rows.values[r, :, n] = values[:, 0]
        rows.positions[r, :, n] = layer.seen_tokens if layer.next_position is None else layer.next_position
        rows.held[r, n] = True
        layer.next_position = None
        rows.lengths[r] = n + 1
        layer.seen_tokens += 1
