"""Static-capacity rows: one layer of every sequence of a static batch, in buffers whose shapes never change.

A captured decode step (`kvbench.engine.static`) needs shapes that depend only on (rows, capacity), never on the
step: here row r of `[R, H, C, D]` buffers holds one sequence's layer, `valid` `[R, H, C]` says which slots hold an
entry (per head: Ada-KV's heads keep different counts), and `positions` `[R, H, C]` each entry's original position.
A decoded token goes to each head's first free slot, chosen on the device, so no index comes from the host. An
evictor overwrites in place: it clears the slot it evicts and the next token takes it, so slot order is not cache
order; cache order, where a method's rule needs it, is the order of positions (entries keep their original
positions and a new token's is the largest). `scores` `[R, H, C]` holds an evictor's accumulated scores slot for
slot. A sequence's layer moves in with `take` and out with `give_back` (a plain layer again, in cache order).
"""
from __future__ import annotations

import torch
from torch import Tensor

from kvbench.cache.kv_cache import KVLayer
from kvbench.cache.varlen import VarlenLayer

BUCKET = 256  # the smallest capacity; larger ones are powers of two, so a run of any prompt lengths makes a few
#              captured steps (dynamo keeps at most `recompile_limit` of them per frame), rows at most 2x their need
LAST = torch.iinfo(torch.long).max  # the position of a free slot when sorting into cache order


def capacity_bucket(entries: int) -> int:
    return max(BUCKET, 1 << (max(entries, 1) - 1).bit_length())


class StaticRows:
    """`keys`/`values` `[R, H, C, D]`, `positions` `[R, H, C]`, `valid` `[R, H, C]`, and `scores` `[R, H, C]` (fp32)
    when an evictor scores this layer. `H` is the stored heads: KV heads, or query heads for a per-query-head
    selection (`repeat` copies of each KV head)."""

    def __init__(self, rows: int, heads: int, capacity: int, dim: int, dtype: torch.dtype, device: torch.device,
                 repeat: int = 1, scored: bool = False):
        self.capacity, self.repeat = capacity, repeat
        self.keys = torch.zeros(rows, heads, capacity, dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.positions = torch.zeros(rows, heads, capacity, dtype=torch.long, device=device)
        self.valid = torch.zeros(rows, heads, capacity, dtype=torch.bool, device=device)
        self.scores = torch.zeros(rows, heads, capacity, dtype=torch.float32, device=device) if scored else None

    @staticmethod
    def layout(layer: KVLayer) -> tuple[int, int, int]:
        """(stored heads, head dim, repeat) of a layer about to move in: rows of one layout share buffers."""
        return layer.keys.shape[1], layer.keys.shape[-1], layer.repeat  # (a per-head variable layer's dense part)

    @staticmethod
    def convertible(layer: KVLayer) -> bool:
        """Dense and per-head variable layers move in; quantized, offloaded and retrieval layers do not."""
        return type(layer) in (KVLayer, VarlenLayer) and layer.is_initialized and layer.shift_inv_freq is None

    def take(self, row: int, layer: KVLayer, scores: Tensor | None = None) -> None:
        """Copy a batch-1 layer's entries (and an evictor's scores `[1, H, n]`, entry for entry) into row `row`."""
        kv = layer.decode_kv()
        n = kv.keys.shape[-2]
        if n > self.capacity:
            raise RuntimeError(f"cache: {n} entries do not fit a static row of {self.capacity}")
        self.valid[row] = False
        self.keys[row, :, :n] = kv.keys[0]
        self.values[row, :, :n] = kv.values[0]
        self.positions[row, :, :n] = kv.positions[0] if kv.positions is not None else layer.positions[0]
        self.valid[row, :, :n] = True if kv.valid is None else kv.valid[0]
        if self.scores is not None:
            self.scores[row] = 0
            if scores is not None:
                self.scores[row, :, :n] = scores[0]

    def cache_order(self) -> Tensor:
        """`[R, H, C]`: the slots of each head sorted by position, free slots last (the eager cache's order)."""
        return self.positions.masked_fill(~self.valid, LAST).argsort(dim=-1)

    def give_back(self, row: int, like: KVLayer) -> tuple[KVLayer, Tensor | None]:
        """Row `row` as a plain layer again (dense when every head holds as many, else per-head variable), in cache
        order, with its scores in that order; `like` is the layer that moved in (its counters travel on)."""
        order = self.cache_order()[row]  # [H, C]
        counts = self.valid[row].sum(-1).tolist()
        layer = KVLayer.__new__(KVLayer)
        layer.__dict__.update({k: v for k, v in like.__dict__.items() if k not in ("keys", "values", "positions")})
        for name in ("flat_keys", "flat_values", "flat_positions"):
            layer.__dict__.pop(name, None)
        layer.repeat = self.repeat
        n = max(counts)
        idx = order[:, :n]
        keys = self.keys[row].gather(1, idx[..., None].expand(-1, -1, self.keys.shape[-1]))[None]
        values = self.values[row].gather(1, idx[..., None].expand(-1, -1, self.values.shape[-1]))[None]
        positions = self.positions[row].gather(1, idx)[None]
        scores = self.scores[row].gather(1, idx)[None] if self.scores is not None else None
        layer.keys, layer.values, layer.positions = keys, values, positions
        layer.dtype, layer.device, layer.is_initialized = keys.dtype, keys.device, True
        if min(counts) == n:
            return layer, scores
        return VarlenLayer.from_selection(layer, [torch.arange(c, device=keys.device) for c in counts]), scores

    def per_entry_bytes(self) -> int:
        return self.keys.shape[-1] * self.keys.element_size() + self.values.shape[-1] * self.values.element_size()

    # --- inside the captured step: no host sync, shapes fixed ----------------------------------------------------
    def write(self, key: Tensor, value: Tensor, position: Tensor, active: Tensor) -> None:
        """One new token per row, `key`/`value` `[R, H_kv, 1, D]` at `position` `[R]`, into each head's first free
        slot; rows not `active` `[R]` (free rows) write nothing valid."""
        if self.repeat > 1:
            key, value = key.repeat_interleave(self.repeat, dim=1), value.repeat_interleave(self.repeat, dim=1)
        r, h, _, d = self.keys.shape
        slot = (~self.valid).to(torch.uint8).argmax(dim=-1, keepdim=True)  # [R, H, 1]
        self.keys.scatter_(2, slot[..., None].expand(r, h, 1, d), key)
        self.values.scatter_(2, slot[..., None].expand(r, h, 1, self.values.shape[-1]), value)
        self.positions.scatter_(2, slot, position.view(r, 1, 1).expand(r, h, 1))
        self.valid.scatter_(2, slot, active.view(r, 1, 1).expand(r, h, 1))
        if self.scores is not None:
            self.scores.scatter_(2, slot, 0.0)

    def attend(self, query: Tensor, scale: Tensor, softcap: float | None, active: Tensor) -> tuple[Tensor, Tensor]:
        """`query` `[R, H_q, 1, D]` over every row's valid slots: the output `[R, 1, H_q, D]` in the query's dtype
        and the masked fp32 logits `[R, H_q, C]`. The two products read K and V once in their own dtype (fp32
        accumulation), the softmax runs in fp32. A free row attends its first slot (its output is not used), never
        nothing. `scale` `[R]`: each row's softmax scale."""
        r, h, c, d = self.keys.shape
        q = query.to(self.keys.dtype).reshape(r * h, -1, d)  # [R * H, G, D]: query head h * G + g reads head h
        logits = torch.bmm(q, self.keys.reshape(r * h, c, d).transpose(1, 2)).view(r, h, -1, c).float()
        logits = logits * scale.view(r, 1, 1, 1)
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        valid = self.valid.clone()
        valid[..., 0] |= ~active.view(r, 1)
        logits = logits.masked_fill(~valid[:, :, None], float("-inf"))
        probs = logits.softmax(dim=-1).view(r * h, -1, c).to(self.values.dtype)
        out = torch.bmm(probs, self.values.reshape(r * h, c, -1))
        return out.view(r, 1, -1, self.values.shape[-1]).to(query.dtype), logits.view(r, -1, c)
