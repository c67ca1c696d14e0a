"""TailorKV's offloaded layers of several samples in one pool, so a batched step retrieves for all of them at once.

Held apart, each sample's offloaded layer pays per step its own channel fetch, approximate-score matmul, two row
gathers and three `cat`s (`kvbench.cache.offloaded`): per-sample dispatch, not arithmetic. Here one layer index of
several samples of one configuration (sinks, recent window, top-k, channels) lives in an `OffloadedRows`: their host
K, V and Kᵀ side by side in flat pools (exactly what each offloaded; a sample's entries leave with it), sinks and
recent window in `[R, H, s + r, D]`, `max|K|` in `[R, H, D]`, generated tokens in shared `Rows`. A step then picks
every row's channels with one top-k, fetches their Kᵀ rows with one gather (each row read up to its own prompt length),
scores the candidates with one matmul (each row's past its own candidates at -inf, as the unpooled batch pads), takes
one top-k and gathers every row's chosen K and V with one `index_select` each. Each sample's ledger still counts
its own bytes, holds and releases in the unpooled order, so the records do not change. CPU only: on CUDA each sample
keeps its pinned host copy and side-stream prefetch (`OffloadedLayer`).
"""
from __future__ import annotations

import torch
from torch import Tensor

from kvbench.cache.kv_cache import DecodeKV
from kvbench.cache.offloaded import OffloadedLayer, group_mean
from kvbench.cache.rows import RowLayer, Rows, append


class OffloadedRows:
    """One layer index of several samples' `OffloadedLayer`s (one configuration), row r for `owners[r]`."""

    def __init__(self, like: OffloadedLayer, capacity: int):
        self.dense = Rows(like, capacity)  # the generated tokens
        self.start, self.recent, self.n_topk, self.n_channels = like.start, like.recent, like.n_topk, like.n_channels
        h, d = like.static_keys.shape[1], like.static_keys.shape[-1]
        self.static_keys = like.static_keys.new_zeros(0, *like.static_keys.shape[1:])
        self.static_values = like.static_values.new_zeros(0, *like.static_values.shape[1:])
        self.static_positions = like.static_positions.new_zeros(0, *like.static_positions.shape[1:])
        self.abs_max = like.abs_max.new_zeros(0, h, d)
        self.host_keys = like.host_keys.new_empty(0, d)  # every row's [H * n, D], row after row
        self.host_values = like.host_values.new_empty(0, d)
        self.host_keys_t = like.host_keys_t.new_empty(0)  # every row's [H, D, n], flattened
        self.segments: list[tuple[int, int, int] | None] = []  # row -> (start in host_keys, in host_keys_t, n)
        self.index: tuple[Tensor, ...] | None = None  # per membership (`_index`)
        self.channels = self.critical = None  # this step's choice and fetched Kᵀ rows

    @staticmethod
    def fits(layer) -> bool:
        return type(layer) is OffloadedLayer and layer.device.type == "cpu" and layer.critical_keys is None

    @property
    def owners(self) -> list:
        return self.dense.owners

    def take(self, layer: OffloadedLayer) -> PooledOffloadedLayer:
        """Move a sample's offloaded layer into a free row; returns the layer that now stands for it."""
        row = self.dense.take(layer).row
        grow = len(self.owners) - self.static_keys.shape[0]
        if grow:
            self.static_keys, self.static_values, self.static_positions, self.abs_max = (
                torch.cat([t, t.new_zeros(grow, *t.shape[1:])])
                for t in (self.static_keys, self.static_values, self.static_positions, self.abs_max))
            self.segments += [None] * grow
        self.static_keys[row], self.static_values[row] = layer.static_keys[0], layer.static_values[0]
        self.static_positions[row], self.abs_max[row] = layer.static_positions[0], layer.abs_max[0]
        d = self.host_keys.shape[-1]
        self.segments[row] = (self.host_keys.shape[0], self.host_keys_t.shape[0], layer.prompt_len)
        self.host_keys = torch.cat([self.host_keys, layer.host_keys.reshape(-1, d)])
        self.host_values = torch.cat([self.host_values, layer.host_values.reshape(-1, d)])
        self.host_keys_t = torch.cat([self.host_keys_t, layer.host_keys_t.reshape(-1)])
        pooled = self.dense.owners[row] = PooledOffloadedLayer.of(layer, self, row)
        self.index = None
        return pooled

    def release(self, row: int) -> None:
        """Free the row and drop its host entries from the pools (later rows' entries move up)."""
        kv, kt, n = self.segments[row]
        h, d = self.static_keys.shape[1], self.host_keys.shape[-1]
        kv_size, kt_size = h * n, h * d * n
        self.host_keys = torch.cat([self.host_keys[:kv], self.host_keys[kv + kv_size:]])
        self.host_values = torch.cat([self.host_values[:kv], self.host_values[kv + kv_size:]])
        self.host_keys_t = torch.cat([self.host_keys_t[:kt], self.host_keys_t[kt + kt_size:]])
        self.segments = [None if s is None or r == row else
                         (s[0] - kv_size if s[0] > kv else s[0], s[1] - kt_size if s[1] > kt else s[1], s[2])
                         for r, s in enumerate(self.segments)]
        self.dense.release(row)
        self.index = None

    def host(self, row: int) -> tuple[Tensor, Tensor, Tensor]:
        """Row `row`'s host K, V `[1, H, n, D]` and Kᵀ `[1, H, D, n]` (views of the pools)."""
        kv, kt, n = self.segments[row]
        h, d = self.static_keys.shape[1], self.host_keys.shape[-1]
        return (self.host_keys[kv:kv + h * n].view(1, h, n, d), self.host_values[kv:kv + h * n].view(1, h, n, d),
                self.host_keys_t[kt:kt + h * d * n].view(1, h, d, n))

    def _index(self) -> tuple[Tensor, ...]:
        """Per membership: where each (row, head)'s K/V rows start in `host_keys` `[R, H, 1]`, its Kᵀ rows in
        `host_keys_t` `[R, H, 1]`, each row's prompt length `[R, 1, 1]`, the Kᵀ columns each row reads `[R, 1, 1,
        n_max]` (past its own length: its last column again) and which candidates are its own `[R, 1, c_max]`."""
        if self.index is None:
            h, d = self.static_keys.shape[1], self.host_keys.shape[-1]
            segments = [s or (0, 0, self.start + self.recent + 1) for s in self.segments]  # a free row reads row 0
            n = torch.tensor([s[2] for s in segments])
            heads = torch.arange(h)
            kv_base = torch.tensor([s[0] for s in segments])[:, None] + heads * n[:, None]
            kt_base = torch.tensor([s[1] for s in segments])[:, None] + heads * d * n[:, None]
            n_max = int(n.max())
            columns = torch.minimum(torch.arange(n_max), n[:, None] - 1)
            candidates = torch.arange(n_max - self.start - self.recent) < (n - self.start - self.recent)[:, None]
            device = self.host_keys.device
            self.index = tuple(t.to(device) for t in (kv_base[..., None], kt_base[..., None], n[:, None, None],
                                                       columns[:, None, None], candidates[:, None]))
        return self.index

    def fetch_channels(self, layers: list[PooledOffloadedLayer], query: Tensor) -> None:
        """`OffloadedLayer.prefetch_many` for rows of this pool, query row i `[S, H_q, 1, D]` for `layers[i]`."""
        query = self._in_rows(layers, query)
        _, kt_base, n, columns, _ = self._index()
        score = group_mean(query, self.abs_max.shape[1]).abs() * self.abs_max.float()
        self.channels = score.topk(self.n_channels, dim=-1).indices  # [R, H, d_s]
        flat = ((kt_base + self.channels * n)[..., None] + columns).view(-1)
        r, h, d_s = self.channels.shape
        self.critical = self.host_keys_t.index_select(0, flat).view(r, h, d_s, -1)
        element = self.host_keys_t.element_size()
        for layer in layers:
            nbytes = h * d_s * layer.prompt_len * element
            layer.ledger.count("critical_keys", nbytes)
            layer.ledger.hold(nbytes)

    def decode_kv(self, layers: list[PooledOffloadedLayer], query: Tensor) -> list[DecodeKV]:
        """`OffloadedLayer.decode_kv_many` for rows of this pool: one top-k retrieval for every row; each layer's
        `DecodeKV` is its row of one block (sinks, recent, fetched, generated), cut to its own generated tokens."""
        if self.critical is None:  # nothing predicted this layer's query (e.g. layer 0): use the real one
            self.fetch_channels(layers, query)
        query = self._in_rows(layers, query)
        kv_base, _, _, _, candidates = self._index()
        r, h, d_s = self.channels.shape
        picked = group_mean(query, h).gather(-1, self.channels)  # [R, H, d_s]
        width = candidates.shape[-1]
        critical = self.critical[..., self.start:self.start + width].float().reshape(r * h, d_s, width)
        approx = torch.bmm(picked.view(r * h, 1, d_s), critical).view(r, h, width)
        tops = approx.masked_fill_(~candidates, float("-inf")).topk(self.n_topk, dim=-1).indices + self.start
        flat = (tops + kv_base).view(-1)
        d = self.host_keys.shape[-1]
        fetched_k = self.host_keys.index_select(0, flat).view(r, h, self.n_topk, d)
        fetched_v = self.host_values.index_select(0, flat).view(r, h, self.n_topk, d)
        lengths = [self.dense.lengths[layer.row] for layer in layers]
        t = max(lengths)
        keys = torch.cat([self.static_keys, fetched_k, self.dense.keys[:, :, :t]], dim=2)
        values = torch.cat([self.static_values, fetched_v, self.dense.values[:, :, :t]], dim=2)
        positions = torch.cat([self.static_positions, tops, self.dense.positions[:, :, :t]], dim=2)
        self._account(layers, tops, fetched_k.element_size() * self.n_topk * d * h)
        self.channels = self.critical = None  # the fetched working set is freed after the step
        held = keys.shape[2] - t  # (a row with fewer generated tokens attends its own entries only: no mask)
        return [DecodeKV(keys[i:i + 1], values[i:i + 1], None, positions[i:i + 1]) if n == t else
                DecodeKV(keys[i:i + 1, :, :held + n], values[i:i + 1, :, :held + n], None,
                         positions[i:i + 1, :, :held + n]) for i, n in zip((layer.row for layer in layers), lengths)]

    def _account(self, layers: list[PooledOffloadedLayer], tops: Tensor, fetched: int) -> None:
        """Each sample's ledger, as its own layer's `_attended` would count it."""
        element = self.host_keys_t.element_size()
        for layer in layers:
            if layer.selections is not None:
                layer.selections.append((self.channels[layer.row:layer.row + 1].cpu(),
                                         tops[layer.row:layer.row + 1].sort(dim=-1).values.cpu()))
            for category in ("topk_keys", "topk_values"):
                layer.ledger.count(category, fetched)
                layer.ledger.hold(fetched)
            critical = self.channels.shape[1] * self.channels.shape[2] * layer.prompt_len * element
            layer.ledger.release(critical, fetched, fetched)

    def _in_rows(self, layers: list[PooledOffloadedLayer], query: Tensor) -> Tensor:
        """Query row i for `layers[i]` -> one row per pool row (a free row's zero)."""
        rows = [layer.row for layer in layers]
        if rows == list(range(len(self.owners))):
            return query
        placed = query.new_zeros(len(self.owners), *query.shape[1:])
        placed[rows] = query
        return placed


class PooledOffloadedLayer(OffloadedLayer):
    """A sample's offloaded layer while it decodes in a batch: its host entries, sinks, recent window and `max|K|`
    in `pool`, its generated tokens in row `row` of `pool.dense` (`keys`, `values`, `positions` are views)."""

    pool: OffloadedRows
    row: int

    @classmethod
    def of(cls, layer: OffloadedLayer, pool: OffloadedRows, row: int) -> PooledOffloadedLayer:
        new = cls.__new__(cls)
        moved = ("keys", "values", "positions", "host_keys", "host_values", "host_keys_t", "static_keys",
                 "static_values", "static_positions", "abs_max")
        new.__dict__.update({k: v for k, v in layer.__dict__.items() if k not in moved})
        new.pool, new.row, new.rows = pool, row, pool.dense
        return new

    keys = RowLayer.keys
    values = RowLayer.values
    positions = RowLayer.positions

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """One generated token `[1, H, 1, D]`, written in place in its row."""
        append([self], [key_states[0]], [value_states[0]])
        return self.keys, self.values

    def decode_kv(self, query: Tensor | None = None) -> DecodeKV:
        """Alone in its step (the batch's other samples elsewhere): its row's retrieval through the pool."""
        return self.pool.decode_kv([self], query)[0]

    # --- accounting, from sizes (every step asks) -------------------------------------------------------------
    def nbytes(self) -> int:
        pool = self.pool
        h, d = pool.static_keys.shape[1], pool.static_keys.shape[-1]
        element = pool.static_keys.element_size()
        return (2 * pool.static_keys.shape[2] * h * d + h * d + 2 * pool.dense.lengths[self.row] * h * d) * element

    def host_nbytes(self) -> int:
        h, d = self.pool.static_keys.shape[1], self.pool.host_keys.shape[-1]
        return 3 * h * self.prompt_len * d * self.pool.host_keys.element_size()

    def entries_per_head(self) -> list[int]:
        attended = self.pool.static_keys.shape[2] + self.n_topk + self.pool.dense.lengths[self.row]
        return [attended] * self.pool.static_keys.shape[1]

    def get_seq_length(self) -> int:
        return self.prompt_len + self.pool.dense.lengths[self.row]

    def release(self) -> None:
        self.pool.release(self.row)

    def detach(self) -> OffloadedLayer:
        """The sample has left the batch but its cache lives on: an `OffloadedLayer` holding copies of its own."""
        pool, row = self.pool, self.row
        layer = OffloadedLayer.__new__(OffloadedLayer)
        layer.__dict__.update({k: v for k, v in self.__dict__.items() if k not in ("pool", "row", "rows")})
        layer.host_keys, layer.host_values, layer.host_keys_t = (t.clone() for t in pool.host(row))
        layer.static_keys, layer.static_values = pool.static_keys[row:row + 1].clone(), \
            pool.static_values[row:row + 1].clone()
        layer.static_positions, layer.abs_max = pool.static_positions[row:row + 1].clone(), \
            pool.abs_max[row:row + 1].clone()
        layer.keys, layer.values, layer.positions = self.keys.clone(), self.values.clone(), self.positions.clone()
        self.release()
        return layer
