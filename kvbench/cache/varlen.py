"""Per-head variable-length cache layer (Ada-KV).

After an Ada-style selection each head keeps a different number of prompt entries. They are stored flattened,
head after head, in `flat_keys/flat_values` `[N, D]` with offsets `cu` `[H + 1]` (the layout of the official
`DynamicCacheSplitHeadFlatten`), so memory is exactly the kept entries, no padding. Tokens generated afterwards
arrive one per head per step, so they go to an ordinary dense part `keys/values` `[1, H, t, D]`: the flattened
prompt part is never rewritten (the official CUDA kernel re-copies the whole layer every step).

Decode attention (`kvbench.attention.decode`, with every other sequence's layer) reads `decode_kv()`: the heads
padded to the longest for this step, then the dense part, with a mask of each head's entries; the padded copy is a
transient of the step, not what the layer holds. Batch size 1 per layer. Where each flattened entry lands is
computed once at selection (host ints for the sizes), so a step never waits on the device for them.

In a batch (`kvbench.engine.batching`, `batch_size` > 1) the samples' layers of one layer index move into a
`VarlenRows`: their flattened entries side by side in one flat pool (still exactly the kept entries) and their
decoded tokens in shared `Rows`. A step then pads every sample's heads to the batch's longest head with ONE
`index_select` per tensor, through an index made when a sample joins or leaves, and attends them in one call: no
per-sample copy, cat or kernel.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kvbench.cache.kv_cache import DecodeKV, KVLayer
from kvbench.cache.rows import RowLayer, Rows


class VarlenLayer(KVLayer):
    """Flattened per-head prompt entries + a dense part for decoded tokens. Built by `from_selection`."""

    is_varlen = True
    own_storage = True

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
        new.offsets = new.cu.tolist()  # plain ints, host-side: sizes need no device sync
        new.max_head_len = max(len(i) for i in idx)
        heads = torch.arange(len(idx), device=lens.device)
        flat_head = heads.repeat_interleave(lens)  # each flat entry's head and place in it (decode padding)
        flat_slot = torch.arange(int(new.cu[-1]), device=lens.device) - new.cu[:-1].repeat_interleave(lens)
        slots = flat_head * new.max_head_len + flat_slot  # where each flat entry lands in [H * longest]
        new.prompt_source = torch.zeros(len(idx) * new.max_head_len, dtype=torch.long, device=lens.device)
        new.prompt_source[slots] = torch.arange(len(slots), device=lens.device)  # each slot's flat entry (padding:
        #                                                                           entry 0, masked by `valid`)
        new.prompt_valid = (torch.arange(new.max_head_len, device=lens.device)[None] < lens[:, None])[None]
        new.prompt_positions = new.flat_positions.new_zeros(len(idx), new.max_head_len)
        new.prompt_positions[flat_head, flat_slot] = new.flat_positions
        new.prompt_positions = new.prompt_positions[None]  # [1, H, longest]: padding reads position 0, masked
        empty = layer.keys.new_empty(1, len(idx), 0, layer.keys.shape[-1])
        new.keys, new.values = empty, empty.clone()
        new.positions = layer.positions.new_empty(1, len(idx), 0)
        new.dtype, new.device, new.is_initialized = layer.keys.dtype, layer.keys.device, True
        new.seen_tokens, new.repeat = layer.seen_tokens, layer.repeat * rep
        return new

    def decode_kv(self, query: Tensor | None = None) -> DecodeKV:
        """This step's keys/values `[1, H, longest + t, D]`: each head's prompt entries padded to the longest,
        then the t decoded tokens; `valid` masks the padding."""
        h, longest, t, d = len(self.offsets) - 1, self.max_head_len, self.keys.shape[-2], self.flat_keys.shape[-1]
        out = []  # (one row copy per slot; a padding slot copies entry 0, which `valid` masks)
        for flat, dense in ((self.flat_keys, self.keys), (self.flat_values, self.values)):
            prompt = flat.index_select(0, self.prompt_source).view(1, h, longest, d)
            out.append(torch.cat([prompt, dense], dim=2) if t else prompt)
        valid = torch.cat([self.prompt_valid, self.prompt_valid.new_ones(1, h, t)], dim=-1)
        return DecodeKV(*out, valid, torch.cat([self.prompt_positions, self.positions], dim=-1))

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


class VarlenRows:
    """One layer index of several samples' `VarlenLayer`s in a batch: the flattened prompt entries of all of them in
    one pool `flat_keys/flat_values` `[N, D]` (sample after sample: exactly the kept entries) and their decoded tokens
    in `dense`, shared `Rows` (`dense.pool` points back here, so batching knows how to attend them)."""

    def __init__(self, like: VarlenLayer, capacity: int):
        self.dense = Rows(like, capacity)
        self.dense.pool = self
        self.flat_keys = like.flat_keys.new_empty(0, like.flat_keys.shape[-1])
        self.flat_values = like.flat_values.new_empty(0, like.flat_values.shape[-1])
        self.segments: list[tuple[int, int] | None] = []  # row -> (start, size) of its entries in the pool
        self.block: tuple[Tensor, Tensor] | None = None  # (pool index of every padded slot, valid): per membership

    @property
    def owners(self) -> list:
        return self.dense.owners

    def take(self, layer: VarlenLayer) -> PooledVarlenLayer:
        """Move a sample's per-head variable layer into a free row; returns the layer that now stands for it."""
        row = self.dense.take(layer).row
        self.segments += [None] * (len(self.dense.owners) - len(self.segments))
        self.segments[row] = (self.flat_keys.shape[0], layer.flat_keys.shape[0])
        self.flat_keys = torch.cat([self.flat_keys, layer.flat_keys])
        self.flat_values = torch.cat([self.flat_values, layer.flat_values])
        pooled = self.dense.owners[row] = PooledVarlenLayer.of(layer, self.dense, row)
        del pooled.flat_keys, pooled.flat_values  # (they live in the pool now)
        self.block = None
        return pooled

    def release(self, row: int) -> None:
        """Free the row and drop its entries from the pool (later samples' entries move up)."""
        start, size = self.segments[row]
        self.flat_keys = torch.cat([self.flat_keys[:start], self.flat_keys[start + size:]])
        self.flat_values = torch.cat([self.flat_values[:start], self.flat_values[start + size:]])
        self.segments = [None if s is None or r == row else (s[0] - size if s[0] > start else s[0], s[1])
                         for r, s in enumerate(self.segments)]
        self.dense.release(row)
        self.block = None

    def entries(self, row: int) -> tuple[Tensor, Tensor]:
        start, size = self.segments[row]
        return self.flat_keys[start:start + size], self.flat_values[start:start + size]

    def decode_kv(self) -> DecodeKV:
        """Every row's keys and values `[R, H, longest + t, D]`: its heads' prompt entries padded to the longest head
        of the batch, then its decoded tokens, with `valid` hiding the padding (a free row shows its first slot)."""
        if self.block is None:
            self.block = self._padding()
        source, valid = self.block
        r, h, longest = valid.shape
        keys = self.flat_keys.index_select(0, source).view(r, h, longest, -1)
        values = self.flat_values.index_select(0, source).view(r, h, longest, -1)
        t = max(self.dense.lengths)
        if t:
            keys = torch.cat([keys, self.dense.keys[:, :, :t]], dim=2)
            values = torch.cat([values, self.dense.values[:, :, :t]], dim=2)
            valid = torch.cat([valid, self.dense.held[:, None, :t].expand(r, h, t)], dim=-1)
        return DecodeKV(keys, values, valid, None)

    def _padding(self) -> tuple[Tensor, Tensor]:
        """The pool index of each row's padded slots `[R * H * longest]` and which are valid `[R, H, longest]`: each
        member's own padding index (`prompt_source`) moved to its place in the pool; padding reads entry 0."""
        owners, device = self.dense.owners, self.flat_keys.device
        longest = max(layer.max_head_len for layer in owners if layer is not None)
        h = self.dense.keys.shape[1]
        sources, valids = [], []
        for row, layer in enumerate(owners):
            if layer is None:
                sources.append(torch.zeros(h, longest, dtype=torch.long, device=device))
                valids.append(torch.arange(longest, device=device).expand(h, longest) == 0)
                continue
            pad = longest - layer.max_head_len
            sources.append(F.pad(layer.prompt_source.view(h, -1) + self.segments[row][0], (0, pad)))
            valids.append(F.pad(layer.prompt_valid[0], (0, pad), value=False))
        return torch.stack(sources).view(-1), torch.stack(valids)


class PooledVarlenLayer(RowLayer):
    """A sample's `VarlenLayer` while it decodes in a batch: its prompt entries in the pool of `rows.pool`, its
    decoded tokens in row `row` of `rows` (`keys`, `values`, `positions` are the views of that row)."""

    own_storage = True
    is_varlen = True

    @property
    def pool(self) -> VarlenRows:
        return self.rows.pool

    def nbytes(self) -> int:
        """Its decoded tokens' bytes in the rows plus its entries' in the pool (counted, not sliced: every step asks)."""
        pool, size = self.pool, self.pool.segments[self.row][1]
        per_entry = pool.flat_keys.shape[-1] * pool.flat_keys.element_size()
        per_entry += pool.flat_values.shape[-1] * pool.flat_values.element_size()
        return super().nbytes() + size * per_entry

    def entries_per_head(self) -> list[int]:
        return (self.head_lens + self.rows.lengths[self.row]).tolist()

    def get_seq_length(self) -> int:
        return self.max_head_len + self.rows.lengths[self.row]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.rows.lengths[self.row] + query_length, 0

    def decode_kv(self, query: Tensor | None = None) -> DecodeKV:
        raise NotImplementedError("cache: a pooled per-head layer is attended with its pool (VarlenRows.decode_kv)")

    def release(self) -> None:
        self.pool.release(self.row)

    def detach(self) -> VarlenLayer:
        """The sample has left the batch but its cache lives on: a `VarlenLayer` holding copies of its entries."""
        layer = VarlenLayer.__new__(VarlenLayer)
        layer.__dict__.update({k: v for k, v in self.__dict__.items() if k not in ("rows", "row")})
        keys, values = self.pool.entries(self.row)
        layer.flat_keys, layer.flat_values = keys.clone(), values.clone()
        layer.keys, layer.values, layer.positions = self.keys.clone(), self.values.clone(), self.positions.clone()
        self.release()
        return layer
