"""Static-capacity rows for the retrieval layers: Quest's pages and PQCache's codes inside the static decode step.

A retrieval layer keeps every entry and attends, each step, those its query retrieves. In a static step
(`kvbench.engine.static`) the row holds them all in slot order (nothing is evicted, so slot = cache order) with
what the retrieval scores next to them, and the step turns the retrieval into a mask over the row's capacity:

- `PagedRows` (Quest, `kvbench.cache.paged`): per-page min/max keys `[R, H, P, D]` over the capacity's pages, the
  page of each written token updated in place; each query head ranks the bounds of the row's pages and attends the
  pages of the first `page_budget - 1` plus the last one (or the first `max(3, page_budget)`, `keep_last=false`).
- `PQRows` (PQCache, `kvbench.cache.pq_offloaded`): the codes `[R, H, M, C]` of every slot and the row's centroids;
  a written token is coded at once (the eager layer codes it when it leaves the window: same key, same centroids,
  same code); each KV head ranks the candidates (slots between the sinks and the window) by their approximate
  softmax weight and attends sinks + its first `n_topk` + window.

Ranks are `kvbench.cache.ranking`'s (ties to the earlier entry), as the eager layers rank, and per-row counts
(budgets, windows, lengths) are tensors, so rows of different budgets share one step. Rows hold the whole cache on
the device (PQCache's candidates too: what the eager layer would fetch from the host is masked in), so the step's
attention reads more than the eager one moves; the records stay the eager layer's: `held_nbytes` is what the eager
layer holds, `ledger_steps` what its ledger counts per step (Quest's pages read, from the step's own choice), and a
sequence leaves as the eager layer it would be (`give_back`: its decoded tokens appended through the layer's own
`update`). A plain layer (a prompt too short for PQCache's codes) takes a row with retrieval off.
"""
from __future__ import annotations

import copy
import math

import torch
from torch import Tensor

from kvbench.cache import pq
from kvbench.cache.kv_cache import KVLayer
from kvbench.cache.ledger import TransferLedger
from kvbench.cache.paged import PagedLayer
from kvbench.cache.pq_offloaded import MOVES, PQOffloadedLayer
from kvbench.cache.ranking import ranks
from kvbench.cache.static import StaticRows, capacity_bucket


class RetrievalRows(StaticRows):
    """What both kinds share: the entries each row held when it joined (its decoded tokens follow them, slot after
    slot), the first free slot of a write, and attention under a mask the retrieval chose."""

    def __init__(self, rows: int, heads: int, capacity: int, dim: int, dtype: torch.dtype, device: torch.device):
        super().__init__(rows, heads, capacity, dim, dtype, device)
        self.start = [0] * rows  # host: entries row r held when it joined

    def take(self, row: int, layer: KVLayer, scores: Tensor | None = None) -> None:
        """A plain layer as `StaticRows.take` copies it; a retrieval layer's entries in slot order (its kind's
        `take` copies what it scores them by)."""
        if type(layer) is KVLayer:
            super().take(row, layer)
        else:
            self.fill(row, layer.keys[0], layer.values[0], layer.positions[0])
        self.start[row] = int(self.valid[row, 0].sum())

    def fill(self, row: int, keys: Tensor, values: Tensor, positions: Tensor) -> None:
        """Row `row` := entries `[H, n, D]` at positions `[H, n]` (what `decode_kv` would gather: no selection)."""
        n = keys.shape[-2]
        if n > self.capacity:
            raise RuntimeError(f"cache: {n} entries do not fit a static row of {self.capacity}")
        self.valid[row] = False
        self.keys[row, :, :n], self.values[row, :, :n], self.positions[row, :, :n] = keys, values, positions
        self.valid[row, :, :n] = True

    def free_slot(self) -> Tensor:
        """`[R, H]`: where each head's next token goes (`StaticRows.write`'s choice)."""
        return (~self.valid).to(torch.uint8).argmax(dim=-1)

    def length(self) -> Tensor:
        """`[R]`: entries each row holds (every head holds all: nothing is evicted)."""
        return self.valid[:, 0].sum(dim=-1)

    def decoded(self, row: int) -> tuple[Tensor, Tensor]:
        """The keys and values `[1, H, n, D]` row `row` decoded since it joined, in order."""
        end = int(self.valid[row, 0].sum())
        return self.keys[row:row + 1, :, self.start[row]:end], self.values[row:row + 1, :, self.start[row]:end]

    def held_nbytes(self) -> Tensor:
        return self.valid.sum(dim=(1, 2)) * self.per_entry_bytes()

    def plain_steps(self, row: int, n: int) -> list[tuple[int, dict, int]]:
        """A row with retrieval off: what its plain layer holds at each step's start; it counts nothing."""
        heads, start = self.keys.shape[1], self.start[row]
        return [((start + j) * heads * self.per_entry_bytes(), {}, 0) for j in range(n)]

    def carry(self, old: StaticRows) -> None:
        """After a regrow: the extra buffers and host state of `old` (smaller, or plain rows: retrieval off)."""
        if isinstance(old, RetrievalRows):
            self.start = list(old.start)
        else:
            self.start = [int(n) for n in old.valid[:, 0].sum(dim=-1).tolist()]


def masked_attention(query: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: Tensor,
                     softcap: float | None, active: Tensor) -> tuple[Tensor, Tensor]:
    """`StaticRows.attend`'s math under a chosen mask: `query` `[R, H_q, 1, D]` over `keys`/`values`
    `[R, H, C, D]`, `mask` `[R, H, C]` (per KV head) or `[R, H_q, C]` (per query head). fp32; a free row attends
    its first slot. Returns the output `[R, 1, H_q, D]` and the masked logits `[R, H_q, C]`."""
    r, h, c, d = keys.shape
    q = query.float().reshape(r * h, -1, d)
    logits = torch.bmm(q, keys.float().reshape(r * h, c, d).transpose(1, 2)).view(r, h, -1, c)
    logits = logits * scale.view(r, 1, 1, 1)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    mask = mask.view(r, h, -1, c)
    first = torch.zeros_like(mask)
    first[..., 0] = True
    mask = mask | (first & ~active.view(r, 1, 1, 1))
    logits = logits.masked_fill(~mask, float("-inf"))
    probs = logits.softmax(dim=-1).view(r * h, -1, c)
    out = torch.bmm(probs, values.float().reshape(r * h, c, -1))
    return out.view(r, 1, -1, values.shape[-1]).to(query.dtype), logits.view(r, -1, c)


class PagedRows(RetrievalRows):
    """Quest's layers (`PagedLayer`): `page_min`/`page_max` `[R, H, P, D]` over the capacity's `P` pages, per row
    `page_budget` and `paged` (False: a dense layer, Quest's first ones), and `reads` `[R, C]`: the entries each step
    read (per KV head the union of its query heads' pages), for the ledger."""

    def __init__(self, rows: int, heads: int, capacity: int, dim: int, dtype: torch.dtype, device: torch.device,
                 page_size: int, keep_last: bool):
        super().__init__(rows, heads, capacity, dim, dtype, device)
        self.page_size, self.keep_last = page_size, keep_last
        n_pages = -(-capacity // page_size)  # (the last page may run past the capacity: masked)
        self.page_min = torch.zeros(rows, heads, n_pages, dim, dtype=dtype, device=device)
        self.page_max = torch.zeros_like(self.page_min)
        self.page_budget = torch.zeros(rows, dtype=torch.long, device=device)
        self.paged = torch.zeros(rows, dtype=torch.bool, device=device)
        self.step = torch.zeros(rows, dtype=torch.long, device=device)
        self.reads = torch.zeros(rows, capacity, dtype=torch.long, device=device)

    def takes(self, layer: KVLayer) -> bool:
        return type(layer) is KVLayer or (isinstance(layer, PagedLayer) and layer.page_size == self.page_size
                                          and layer.keep_last == self.keep_last)

    def take(self, row: int, layer: KVLayer, scores: Tensor | None = None) -> None:
        super().take(row, layer)
        paged = isinstance(layer, PagedLayer) and layer.page_budget is not None
        self.page_min[row], self.page_max[row] = 0, 0
        if paged:
            n = layer.page_min.shape[2]
            self.page_min[row, :, :n], self.page_max[row, :, :n] = layer.page_min[0], layer.page_max[0]
        self.paged[row] = paged
        self.page_budget[row] = layer.page_budget if paged else 0
        self.step[row], self.reads[row] = 0, 0

    def carry(self, old: StaticRows) -> None:
        super().carry(old)
        if isinstance(old, PagedRows):
            n, c = old.page_min.shape[2], old.capacity
            self.page_min[:, :, :n], self.page_max[:, :, :n] = old.page_min, old.page_max
            self.page_budget[:], self.paged[:], self.step[:] = old.page_budget, old.paged, old.step
            self.reads[:, :c] = old.reads

    # --- inside the step ----------------------------------------------------------------------------------------
    def write(self, key: Tensor, value: Tensor, position: Tensor, active: Tensor) -> None:
        """`StaticRows.write`, and the bounds of the page the token lands in: the token alone on a fresh page, else
        the elementwise min/max with it (exact: what `page_bounds` finds over the page's entries)."""
        slot = self.free_slot()  # [R, H]
        super().write(key, value, position, active)
        r, h, _, d = self.page_min.shape
        index = (slot // self.page_size).view(r, h, 1, 1).expand(r, h, 1, d)
        fresh = (slot % self.page_size == 0).view(r, h, 1, 1)
        low, high = self.page_min.gather(2, index), self.page_max.gather(2, index)
        self.page_min.scatter_(2, index, torch.where(fresh, key, torch.minimum(low, key)))
        self.page_max.scatter_(2, index, torch.where(fresh, key, torch.maximum(high, key)))

    def attend(self, query: Tensor, scale: Tensor, softcap: float | None, active: Tensor) -> tuple[Tensor, Tensor]:
        """`PagedLayer.decode_kv`'s choice as a mask: a row with more pages than its budget attends, per query head,
        its best pages by the bound `q+ . max + q- . min` (and the last one); any other row attends everything."""
        r, h, n_pages, d = self.page_min.shape
        length = self.length()  # [R]
        pages_in = (length + self.page_size - 1) // self.page_size  # [R]
        q = query.float().reshape(r, h, -1, d)  # [R, H, G, D]
        bound = (q.clamp(min=0) @ self.page_max.float().transpose(-1, -2)
                 + q.clamp(max=0) @ self.page_min.float().transpose(-1, -2)).reshape(r, -1, n_pages)
        page = torch.arange(n_pages, device=query.device).view(1, 1, n_pages)
        budget = self.page_budget.view(r, 1, 1)
        last = (pages_in - 1).view(r, 1, 1)
        if self.keep_last:  # the newest page always, the others compete for the rest
            compete, count = page < last, budget - 1
        else:
            compete, count = page <= last, budget.clamp(min=3)
        chosen = (ranks(bound.masked_fill(~compete, float("-inf"))) < count) & compete
        if self.keep_last:
            chosen = chosen | (page == last)
        selecting = (self.paged & (pages_in > self.page_budget)).view(r, 1, 1)
        pages = torch.where(selecting, chosen, page <= last)  # [R, H_q, P]
        group = pages.shape[1] // h
        mask = pages.repeat_interleave(self.page_size, dim=-1)[..., :self.capacity] & \
            self.valid.repeat_interleave(group, dim=1)
        sizes = (length.view(r, 1) - page.view(1, n_pages) * self.page_size).clamp(0, self.page_size)  # [R, P]
        union = pages.view(r, h, group, n_pages).any(dim=2)  # [R, H, P]: the pages each KV head reads
        entries = (union * sizes.view(r, 1, n_pages)).sum(dim=(1, 2))
        self.reads.scatter_(1, self.step.clamp(max=self.capacity - 1).view(r, 1), entries.view(r, 1))
        self.step.add_(active.long())
        return masked_attention(query, self.keys, self.values, mask, scale, softcap, active)

    # --- accounting ---------------------------------------------------------------------------------------------
    def held_nbytes(self) -> Tensor:
        """What each row's eager layer holds: its K/V and, paged, 2 x D per page and head of bounds."""
        r, h, _, d = self.page_min.shape
        pages_in = (self.length() + self.page_size - 1) // self.page_size
        meta = self.paged.long() * pages_in * (2 * h * d * self.page_min.element_size())
        return super().held_nbytes() + meta

    def ledger_steps(self, row: int, n: int, layer: KVLayer) -> list[tuple[int, dict, int]]:
        """Per decode step, as the eager layer counts it: (bytes held at the step's start, {category: bytes read},
        transient bytes)."""
        if not isinstance(layer, PagedLayer):
            return self.plain_steps(row, n)
        h, d = self.keys.shape[1], self.keys.shape[-1]
        size, meta = self.keys.element_size(), 2 * h * d * self.page_min.element_size()
        paged, start = layer.page_budget is not None, self.start[row]
        out = []
        for j, entries in enumerate(self.reads[row, :n].tolist()):
            held, length = start + j, start + j + 1
            pages = -(-length // self.page_size)
            counts = {"page_keys": entries * d * size, "page_values": entries * d * size}
            if paged and pages > layer.page_budget:
                counts["page_metadata"] = pages * meta
            out.append((held * h * self.per_entry_bytes() + (-(-held // self.page_size) * meta if paged else 0),
                        counts, 0))
        return out

    def give_back(self, row: int, like: KVLayer) -> tuple[KVLayer, Tensor | None]:
        """The eager layer this row would be: `like` (as it joined) with the decoded tokens appended by its own
        `update` (bounds refreshed as its steps refreshed them)."""
        if not isinstance(like, PagedLayer):
            return super().give_back(row, like)
        layer = copy.copy(like)
        keys, values = self.decoded(row)
        if keys.shape[-2]:
            layer.update(keys, values)
        return layer, None


class PQRows(RetrievalRows):
    """PQCache's layers (`PQOffloadedLayer`): `codes` `[R, H, M, C]` of every slot from the sinks on, the row's
    `centroids` `[R, H, M, K, D / M]`, and per row `sink`, `recent`, `n_topk` and `coded` (False: a plain layer)."""

    def __init__(self, rows: int, heads: int, capacity: int, dim: int, dtype: torch.dtype, device: torch.device,
                 partitions: int, clusters: int):
        super().__init__(rows, heads, capacity, dim, dtype, device)
        self.codes = torch.zeros(rows, heads, partitions, capacity, dtype=torch.uint8, device=device)
        self.centroids = torch.zeros(rows, heads, partitions, clusters, dim // partitions, dtype=dtype, device=device)
        self.coded = torch.zeros(rows, dtype=torch.bool, device=device)
        self.sink, self.recent, self.n_topk = (torch.zeros(rows, dtype=torch.long, device=device) for _ in range(3))

    def takes(self, layer: KVLayer) -> bool:
        return type(layer) is KVLayer or (isinstance(layer, PQOffloadedLayer) and layer.codes.shape[2] ==
                                          self.codes.shape[2] and layer.centroids.shape[3] == self.centroids.shape[3])

    def take(self, row: int, layer: KVLayer, scores: Tensor | None = None) -> None:
        self.codes[row], self.centroids[row] = 0, 0
        self.coded[row] = isinstance(layer, PQOffloadedLayer)
        if not isinstance(layer, PQOffloadedLayer):
            super().take(row, layer)
            return
        sink, n_cand, window = layer.sink, layer.n_cand, layer.keys.shape[-2]
        n, device = sink + n_cand + window, self.keys.device
        keys, values = (torch.cat([first, host[:, :, :n_cand].to(device), last], dim=2)[0] for first, host, last in
                        ((layer.sink_keys, layer.host_keys, layer.keys),
                         (layer.sink_values, layer.host_values, layer.values)))
        candidates = torch.arange(sink, sink + n_cand, device=device).expand(1, self.keys.shape[1], n_cand)
        self.fill(row, keys, values, torch.cat([layer.sink_positions, candidates, layer.positions], dim=2)[0])
        self.start[row] = n
        coded = min(layer.n_coded, n - sink)  # (window tokens decoded earlier get their code here)
        self.codes[row, :, :, sink:sink + coded] = layer.codes[0, :, :, :coded].to(device)
        self.centroids[row] = layer.centroids[0].to(device)
        if coded < n - sink:
            fresh = pq.encode(self.keys[row:row + 1, :, sink + coded:n], self.centroids[row:row + 1])
            self.codes[row, :, :, sink + coded:n] = fresh[0]
        self.sink[row], self.recent[row], self.n_topk[row] = sink, layer.recent, layer.n_topk

    def carry(self, old: StaticRows) -> None:
        super().carry(old)
        if isinstance(old, PQRows):
            self.codes[..., :old.capacity] = old.codes
            self.centroids[:] = old.centroids
            for name in ("coded", "sink", "recent", "n_topk"):
                getattr(self, name)[:] = getattr(old, name)

    # --- inside the step ----------------------------------------------------------------------------------------
    def write(self, key: Tensor, value: Tensor, position: Tensor, active: Tensor) -> None:
        """`StaticRows.write`, and the token's code under the row's centroids (`pq.encode`, the eager rule)."""
        slot = self.free_slot()  # [R, H]
        super().write(key, value, position, active)
        r, h, m, _ = self.codes.shape
        self.codes.scatter_(3, slot.view(r, h, 1, 1).expand(r, h, m, 1), pq.encode(key, self.centroids))

    def window_start(self) -> Tensor:
        """`[R, 1]`: the first slot of each row's window (the last `recent + 1` entries, the newest included)."""
        return (self.length() - self.recent - 1).view(-1, 1)

    def attend(self, query: Tensor, scale: Tensor, softcap: float | None, active: Tensor) -> tuple[Tensor, Tensor]:
        """`PQOffloadedLayer.decode_kv`'s choice as a mask: sinks, window, and per KV head the candidates of the
        `n_topk` largest approximate weights (softmax of the PQ logits / sqrt(D), summed over the group)."""
        r, h, _, c = self.codes.shape
        slot = torch.arange(c, device=query.device).view(1, c)
        window = self.window_start()
        sink = self.sink.view(r, 1)
        candidate = (slot >= sink) & (slot < window)  # [R, C]
        logits = pq.approximate_logits(query, self.centroids, self.codes)  # [R, H, G, C]
        logits = (logits / math.sqrt(query.shape[-1])).masked_fill(~candidate.view(r, 1, 1, c), float("-inf"))
        weight = logits.softmax(dim=-1).sum(dim=2).masked_fill(~candidate.view(r, 1, c), -1.0)  # [R, H, C]
        chosen = (ranks(weight) < self.n_topk.view(r, 1, 1)) & candidate.view(r, 1, c)
        local = ((slot < sink) | (slot >= window)).view(r, 1, c) & self.valid
        mask = torch.where(self.coded.view(r, 1, 1), local | chosen, self.valid)
        return masked_attention(query, self.keys, self.values, mask, scale, softcap, active)

    # --- accounting ---------------------------------------------------------------------------------------------
    def held_nbytes(self) -> Tensor:
        """What each row's eager layer holds on the device: sinks and window (a plain layer: everything)."""
        slot = torch.arange(self.capacity, device=self.valid.device).view(1, -1)
        local = ((slot < self.sink.view(-1, 1)) | (slot >= self.window_start()))[:, None] & self.valid
        counted = torch.where(self.coded.view(-1, 1, 1), local, self.valid)
        return counted.sum(dim=(1, 2)) * self.per_entry_bytes()

    def ledger_steps(self, row: int, n: int, layer: KVLayer) -> list[tuple[int, dict, int]]:
        """Per decode step, as the eager layer counts it (a function of the step only: window tokens sent to the
        host, codes and centroids copied to the device, `min(n_topk, candidates)` rows of K and V fetched)."""
        if not isinstance(layer, PQOffloadedLayer):
            return self.plain_steps(row, n)
        h, d = self.keys.shape[1], self.keys.shape[-1]
        size_k, size_v = self.keys.element_size(), self.values.element_size()
        m = layer.codes.shape[2]
        codebook = layer.centroids.numel() * layer.centroids.element_size()
        window, n_cand, out = layer.keys.shape[-2], layer.n_cand, []
        for _ in range(n):
            held = (layer.sink + window) * h * d * (size_k + size_v)
            window += 1
            leaving = max(0, window - layer.recent - 1)
            window, n_cand = window - leaving, n_cand + leaving
            top = min(layer.n_topk, n_cand)
            counts = {"window_keys": leaving * h * d * size_k, "window_values": leaving * h * d * size_v,
                      "pq_codes": h * m * n_cand * layer.codes.element_size(), "pq_centroids": codebook,
                      "topk_keys": h * top * d * size_k, "topk_values": h * top * d * size_v}
            transient = sum(counts[c] for c in ("pq_codes", "pq_centroids", "topk_keys", "topk_values"))
            out.append((held, counts, transient))
        return out

    def give_back(self, row: int, like: KVLayer) -> tuple[KVLayer, Tensor | None]:
        """The eager layer this row would be: `like` (as it joined) with the decoded tokens appended one by one by
        its own `update` (window tokens leave for the host and get their codes as they did each step); what that
        moves was counted by `ledger_steps`, so a scratch ledger takes it."""
        if not isinstance(like, PQOffloadedLayer):
            return super().give_back(row, like)
        layer = copy.copy(like)
        layer.ledger = TransferLedger(MOVES)
        keys, values = self.decoded(row)
        for j in range(keys.shape[-2]):
            layer.update(keys[:, :, j:j + 1], values[:, :, j:j + 1])
        layer.ledger = like.ledger
        return layer, None


# --- what the static decoder asks (kvbench.engine.static) ---------------------------------------------------------
def convertible(layer: KVLayer) -> bool:
    """A layer that moves into static rows: `StaticRows.convertible`'s, or a retrieval layer."""
    return StaticRows.convertible(layer) or isinstance(layer, (PagedLayer, PQOffloadedLayer)) and layer.is_initialized


def entries(layer: KVLayer) -> int:
    """Entries the layer holds, wherever they are (a PQCache layer's candidates sit on the host)."""
    if isinstance(layer, PQOffloadedLayer):
        return layer.get_seq_length()
    return layer.keys.shape[-2] if isinstance(layer, PagedLayer) else layer.decode_kv().keys.shape[-2]


def capacity(layer: KVLayer, max_new_tokens: int) -> int:
    """A row's capacity: every entry and every token to decode, a bucket, whole pages (Quest)."""
    need = capacity_bucket(entries(layer) + max_new_tokens)
    if isinstance(layer, PagedLayer):
        need = -(-need // layer.page_size) * layer.page_size
    return need


def takes(rows: StaticRows, layer: KVLayer) -> bool:
    """Whether `rows` can hold `layer` (retrieval rows take their layers and plain ones, retrieval off)."""
    return rows.takes(layer) if isinstance(rows, RetrievalRows) else StaticRows.convertible(layer)


def new_rows(layer: KVLayer, old: StaticRows | None, rows: int, capacity: int) -> StaticRows | None:
    """Rows for `layer` (of `old`'s kind where `old` takes it), or None where plain `StaticRows` do."""
    kind = old if isinstance(old, RetrievalRows) and old.takes(layer) else layer
    shape = (rows, layer.keys.shape[1], capacity, layer.keys.shape[-1], layer.keys.dtype, layer.keys.device)
    if isinstance(kind, (PagedRows, PagedLayer)):
        return PagedRows(*shape, kind.page_size, kind.keep_last)
    if isinstance(kind, (PQRows, PQOffloadedLayer)):
        return PQRows(*shape, kind.codes.shape[2], kind.centroids.shape[3])  # (partitions, centroids)
    return None


def carry(old: StaticRows, new: StaticRows) -> None:
    """After `StaticDecoder._regrow` copied the common buffers: the retrieval rows' own."""
    if isinstance(new, RetrievalRows):
        if isinstance(old, RetrievalRows) and type(old) is not type(new):
            raise ValueError("step=static: Quest and PQCache samples share no rows; use step=eager")
        new.carry(old)


def held_nbytes(rows: StaticRows) -> Tensor:
    """`[R]`: the K/V bytes each row's eager layer would hold now."""
    return rows.held_nbytes() if isinstance(rows, RetrievalRows) else rows.valid.sum(dim=(1, 2)) * \
        rows.per_entry_bytes()


def settle_ledger(ledger: TransferLedger | None, layers: list[StaticRows], row: int, eager: list[KVLayer],
                  n: int) -> None:
    """Append row `row`'s `n` decode steps to its sample's ledger as the eager step counts them (`StepStart` opens
    each with the bytes held, then each layer counts what it reads or moves); `eager`: its layers as they joined."""
    if ledger is None or not n or not any(isinstance(rows, RetrievalRows) for rows in layers):
        return
    per_layer = []
    for rows, layer in zip(layers, eager):
        if isinstance(rows, RetrievalRows):
            per_layer.append(rows.ledger_steps(row, n, layer))
        else:  # a plain layer of the sample: one entry per head more each step
            now, heads = int(rows.valid[row].sum()), rows.keys.shape[1]
            per_layer.append([((now - (n - j) * heads) * rows.per_entry_bytes(), {}, 0) for j in range(n)])
    for j in range(n):
        ledger.begin_step(sum(steps[j][0] for steps in per_layer))
        for _, counts, transient in (steps[j] for steps in per_layer):
            for category, nbytes in counts.items():
                ledger.count(category, nbytes)
            ledger.transient_peak[-1] = max(ledger.transient_peak[-1], transient)
