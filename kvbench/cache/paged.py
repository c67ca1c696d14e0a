"""A paged cache layer with query-aware page selection (Quest, Tang et al. 2024).

Nothing is evicted and nothing leaves the device: the layer keeps every key and value (prompt and generated) as a
dense `[B, H_kv, T, D]` cache, cut into pages of `page_size` consecutive tokens (the last one partial), and per page
and KV head the elementwise minimum and maximum key `[B, H_kv, pages, D]` (the page metadata, updated as tokens are
appended). Each decode step (`decode_kv`) bounds q·k over a page from above by

    bound(q, page) = sum_d max(q_d * min_d, q_d * max_d)   (= q⁺·max + q⁻·min, two matmuls)

and the query attends exactly to the entries of its best pages. With `keep_last=True` (the reference kernels,
`quest/utils/controller.py`: "page budget including the last page") the page holding the newest token is always
attended and the other `page_budget - 1` pages are the top bounds among the rest; with `keep_last=False` (the
reference's accuracy-evaluation script, `evaluation/quest_attention.py`) the top `max(3, page_budget)` pages compete,
the last one included. Under GQA each query head picks its own pages over its KV head's keys (the evaluation script
repeats K/V per query head; the kernels are MHA only), so `decode_kv` hands attention one row of entries per query
head. When the cache has no more pages than the budget the step attends everything (the kernels skip the estimate).

The ledger counts what each step reads (direction `read`): the page metadata it scores, and the keys and values of
the pages it attends, per KV head the union of its query heads' pages. Memory held (`nbytes`) is the whole cache plus
the metadata: Quest saves reads, not memory.

Several tokens appended at once (`generation.feed`: query=agnostic's question, a conversation's later turns) join
the pages as decoded tokens do, filling the last partial page first, and their bounds are refreshed, so the pages
after a feed are those built from scratch over the same keys. The chunk itself attends the whole cache, densely
and causally among its own tokens: the reference's kernels append a multi-token chunk to the paged cache
(`append_kv_cache_prefill`) and run `prefill_with_paged_kv_cache` over every page (mit-han-lab/Quest,
`quest/utils/__init__.py`), and its evaluation script attends densely whenever q_len > 1. What it reads goes to the
ledger's `feed_bytes` (every page's keys and values, once per feed), not to a decode step.
"""
from __future__ import annotations

import torch
from torch import Tensor

from kvbench.cache.kv_cache import DecodeKV, KVLayer
from kvbench.cache.ledger import TransferLedger
from kvbench.cache.ranking import top_first

READS = {"page_metadata": "read", "page_keys": "read", "page_values": "read"}


class PagedLayer(KVLayer):
    """Dense K/V + per-page min/max keys; see the module docstring. Built by `from_layer`."""

    own_storage = True

    @classmethod
    def from_layer(cls, layer: KVLayer, page_size: int, page_budget: int | None, ledger: TransferLedger,
                   keep_last: bool = True) -> "PagedLayer":
        """Take over a filled prompt layer (its tensors, not a copy). `page_budget=None`: a dense layer (Quest's
        first layers) that attends everything and only counts what it reads."""
        if layer.repeat != 1 or layer.shift_inv_freq is not None:
            raise ValueError("quest: a paged layer takes a plain prefilled layer (KV heads, original positions)")
        new = cls()
        new.keys, new.values, new.positions = layer.keys, layer.values, layer.positions
        new.dtype, new.device, new.is_initialized = layer.keys.dtype, layer.keys.device, True
        new.seen_tokens = layer.seen_tokens
        new.page_size, new.page_budget, new.keep_last, new.ledger = page_size, page_budget, keep_last, ledger
        new.page_min = new.page_max = None
        if page_budget is not None:
            new.page_min, new.page_max = page_bounds(layer.keys, page_size)
        new.selections = None  # set to a list to record each step's pages `[B, H_q, k]` for tests
        return new

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Append (any number of tokens: a prefill on top sees the whole cache, exactly) and refresh the bounds of
        the pages they touch."""
        first = self.keys.shape[-2]
        out = super().update(key_states, value_states, *args, **kwargs)
        if self.page_budget is not None:
            page0 = first // self.page_size  # the first touched page (possibly the old last, partial one)
            low, high = page_bounds(self.keys[:, :, page0 * self.page_size:], self.page_size)
            self.page_min = torch.cat([self.page_min[:, :, :page0], low], dim=2)
            self.page_max = torch.cat([self.page_max[:, :, :page0], high], dim=2)
        return out

    def n_pages(self) -> int:
        return -(-self.keys.shape[-2] // self.page_size)

    def decode_kv(self, query: Tensor | None = None) -> DecodeKV:
        """What one token `[B, H_q, 1, D]` attends: per query head the entries of its selected pages (the new token,
        appended by `update`, is in the last page). A chunk of several tokens `[B, H_q, q, D]` (a fed question or
        turn) attends every entry, as the reference's prefill kernel does (causal among the chunk: the caller's)."""
        b, h_kv, t, d = self.keys.shape
        n_pages, entry = self.n_pages(), 2 * d * self.keys.element_size()
        if query is not None and query.shape[2] > 1:  # a fed chunk (already appended) attends every page densely
            self.ledger.fed("page_keys", b * h_kv * t * entry // 2)
            self.ledger.fed("page_values", b * h_kv * t * entry // 2)
            return KVLayer.decode_kv(self)
        if self.page_budget is None or n_pages <= self.page_budget:
            self.ledger.count("page_keys", b * h_kv * t * entry // 2)
            self.ledger.count("page_values", b * h_kv * t * entry // 2)
            return KVLayer.decode_kv(self)
        pages = self.select_pages(query)  # [B, H_q, k]
        if self.selections is not None:
            self.selections.append(pages.sort(dim=-1).values.cpu())
        h_q = pages.shape[1]
        group = h_q // h_kv
        slots = (pages[..., None] * self.page_size + torch.arange(self.page_size, device=pages.device)).flatten(2)
        valid = slots < t  # only the last page can be partial
        slots = slots.clamp(max=t - 1)
        batch = torch.arange(b, device=slots.device)[:, None, None]
        head = (torch.arange(h_q, device=slots.device) // group)[None, :, None]
        self._count_reads(pages, h_kv, group, n_pages, t)
        partial = t % self.page_size != 0  # (known on the host: no wait on the device)
        return DecodeKV(self.keys[batch, head, slots], self.values[batch, head, slots], valid if partial else None,
                        self.positions[batch, head, slots])

    def select_pages(self, query: Tensor) -> Tensor:
        """Page indices `[B, H_q, k]` each query head attends, best bound first (ties: the earlier page,
        `kvbench.cache.ranking`)."""
        b, h_kv, _, d = self.page_min.shape
        n_pages = self.page_min.shape[2]
        q = query.float().reshape(b, h_kv, -1, d)  # [B, H_kv, G, D]
        bound = (q.clamp(min=0) @ self.page_max.float().transpose(-1, -2)
                 + q.clamp(max=0) @ self.page_min.float().transpose(-1, -2))  # [B, H_kv, G, pages]
        bound = bound.reshape(b, -1, n_pages)
        if not self.keep_last:
            return top_first(bound, min(max(3, self.page_budget), n_pages))
        top = top_first(bound[..., :-1], self.page_budget - 1)
        last = torch.full_like(top[..., :1], n_pages - 1)
        return torch.cat([top, last], dim=-1)

    def _count_reads(self, pages: Tensor, h_kv: int, group: int, n_pages: int, t: int) -> None:
        """This step's reads: the metadata of every page, and per KV head the union of its query heads' pages."""
        b, d, size = pages.shape[0], self.keys.shape[-1], self.keys.element_size()
        self.ledger.count("page_metadata", 2 * b * h_kv * n_pages * d * self.page_min.element_size())
        chosen = torch.zeros(b, h_kv, n_pages, dtype=torch.bool, device=pages.device)
        chosen.scatter_(2, pages.reshape(b, h_kv, group * pages.shape[-1]), True)
        lengths = torch.full((n_pages,), self.page_size, device=pages.device)
        lengths[-1] = t - (n_pages - 1) * self.page_size
        entries = (chosen * lengths).sum()
        self.ledger.count("page_keys", entries * d * size)
        self.ledger.count("page_values", entries * d * size)

    # --- accounting -------------------------------------------------------------------------------------------
    def keep(self, idx: Tensor) -> None:
        raise NotImplementedError("cache: a paged (Quest) layer keeps every token; eviction does not apply")

    def nbytes(self) -> int:
        """Bytes held: the whole K/V and the page metadata."""
        meta = 0 if self.page_min is None else 2 * self.page_min.numel() * self.page_min.element_size()
        return super().nbytes() + meta

    def entries_per_head(self) -> list[int]:
        """Entries a step attends per KV head at most: the page budget's tokens, or the whole cache when smaller."""
        t = self.keys.shape[-2]
        attended = t if self.page_budget is None else min(t, self.page_budget * self.page_size)
        return [attended] * self.keys.shape[1]


def page_bounds(keys: Tensor, page_size: int) -> tuple[Tensor, Tensor]:
    """Elementwise min and max keys per page `[B, H, ceil(T / page_size), D]` (the last page over its real
    entries only)."""
    b, h, t, d = keys.shape
    n_pages = -(-t // page_size)
    pad = n_pages * page_size - t
    if pad:
        last = keys[:, :, -1:].expand(b, h, pad, d)  # repeating a real entry leaves min and max unchanged
        keys = torch.cat([keys, last], dim=2)
    paged = keys.reshape(b, h, n_pages, page_size, d)
    return paged.amin(dim=3), paged.amax(dim=3)
