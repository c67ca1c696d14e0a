"""Rows of samples that evict while decoding: one layer of several H2O samples of one budget in one buffer.

Held as separate layers, each such sample pays per step and layer its own append (three `cat`s), its own eviction
(an index, two row gathers, a position and a score gather) and a stacking copy before the shared attention call:
per-sample dispatch, not arithmetic. Here row r of `[R, H, budget + 1, D]` buffers holds one sample's layer, which
between steps holds exactly `budget` entries: a step writes every row's token at slot `budget` in one copy, one
attention call reads all rows as they lie, and one gather keeps `budget` entries of every row (`keep_all`), in cache
order at the row's start, as `KVLayer.keep` would. `scores` holds the evictor's accumulated scores slot for slot;
the evictor's rule itself stays in `kvbench.methods.decoding` (`EvictionState.decode_rows`). A row's layer is a
`RowLayer` view, so its accounting is what its own tensors would give.
"""
from __future__ import annotations

import torch
from torch import Tensor

from kvbench.cache.kv_cache import KVLayer, gather_rows, row_index
from kvbench.cache.rows import RowLayer, Rows


class EvictingRows(Rows):
    """`Rows` of capacity `budget + 1` whose members each hold `budget` entries between steps; `scores`
    `[R, H, budget + 1]` (fp32), `next_positions` `[R]` the position each row's next token gets, `states[r]` row r's
    evictor state (opaque here: `kvbench.methods.decoding` reads it)."""

    def __init__(self, like: KVLayer, budget: int):
        super().__init__(like, budget + 1)
        self.budget = budget
        self.scores = torch.zeros(0, like.keys.shape[1], budget + 1, dtype=torch.float32, device=like.keys.device)
        self.next_positions = torch.zeros(0, dtype=torch.long, device=like.keys.device)
        self.states: list[object | None] = []

    @staticmethod
    def fits(layer: KVLayer, budget: int) -> bool:
        """A dense layer holding exactly `budget` entries per head (an evictor's steady state after prefill)."""
        return type(layer) is KVLayer and layer.is_initialized and layer.shift_inv_freq is None \
            and layer.repeat == 1 and layer.keys.shape[0] == 1 and layer.keys.shape[-2] == budget

    def take_scored(self, layer: KVLayer, scores: Tensor, state: object) -> EvictingLayer:
        """Move a sample's layer and its scores `[1, H, budget]` into a free row."""
        row = self.take(layer).row
        owner = self.owners[row] = EvictingLayer.of(layer, self, row)
        self.scores[row, :, :self.budget] = scores[0]
        self.next_positions[row] = layer.seen_tokens
        self.states[row] = state
        return owner

    def release(self, row: int) -> None:
        super().release(row)
        self.states[row] = None

    def _grow(self) -> None:
        super()._grow()
        self.scores = torch.cat([self.scores, self.scores.new_zeros(1, *self.scores.shape[1:])])
        self.next_positions = torch.cat([self.next_positions, self.next_positions.new_zeros(1)])
        self.states.append(None)

    def append_all(self, layers: list[EvictingLayer], keys: Tensor, values: Tensor) -> None:
        """Every row's new token at slot `budget`: `keys`/`values` `[R, H, D]` in row order (a free row's is any)."""
        slot = self.budget
        self.keys[:, :, slot] = keys
        self.values[:, :, slot] = values
        self.positions[:, :, slot] = self.next_positions[:, None]
        self.next_positions += 1
        self.scores[:, :, slot] = 0.0  # the new entry's score starts from zero, as `EvictionState.decode` pads
        for layer in layers:
            self.lengths[layer.row] = slot + 1
            layer.seen_tokens += 1
        self.held[:, slot] = True

    def keep_all(self, idx: Tensor) -> None:
        """Keep entries `idx` `[R, H, budget]` (sorted) of every row, compacted at the row's start (the last slot
        is free again); the scores go along."""
        budget = self.budget
        flat = row_index(idx, budget + 1)
        for buffer in (self.keys, self.values):
            buffer[:, :, :budget] = gather_rows(buffer, idx, flat)
        self.positions[:, :, :budget] = self.positions.gather(2, idx)
        self.scores[:, :, :budget] = self.scores.gather(2, idx)
        for row, owner in enumerate(self.owners):
            if owner is not None:
                self.lengths[row] = budget
        self.held[:, budget] = False


class EvictingLayer(RowLayer):
    """A sample's layer held in row `row` of an `EvictingRows`: a view of its row, evicted with the others."""

    def row_scores(self) -> Tensor:
        """A copy of its accumulated scores `[1, H, n]`, entry for entry (handed back when it leaves)."""
        return self.rows.scores[self.row:self.row + 1, :, :self.rows.lengths[self.row]].clone()

    def keep(self, idx: Tensor) -> None:
        raise NotImplementedError("cache: a row of evicting samples is evicted with its rows (EvictingRows.keep_all)")
