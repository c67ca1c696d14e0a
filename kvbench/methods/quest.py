"""Quest (Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference"): query-aware
page retrieval without eviction.

Reference: mit-han-lab/Quest@01c1623 (`evaluation/quest_attention.py`, the accuracy path; `quest/utils/controller.py`
and `quest/models/llama.py`, the kernels' path). The prefill is exact (both paths run full attention when
q_len > 1). Afterwards every layer keeps its whole cache (`kvbench.cache.paged.PagedLayer`), in pages of `page_size`
tokens with per-page min/max keys; each decode step attends the pages with the highest upper bound of q·k. The first
`dense_layers` layers attend everything (both reference paths skip layers 0 and 1).

Budget semantics: `budget` = the token budget; `budget // page_size` pages are attended per query head per step,
the last (partial) page holding the newest token included (the kernels' "page budget including the last page"). The
TailorKV tables' settings: page 16, budget 196 (LongBench: 12 pages = 192 tokens, which is why its Table 3 prints
192) and 1024 (RULER, InfiniteBench).

Question-agnostic runs and conversations (`query=agnostic`, `dataset.turns`): the fed question or turn is appended
to the pages (the last partial page first, bounds refreshed, exactly as decoded tokens join them) and attends the
whole cache densely, causally among its own tokens: the reference appends a multi-token chunk to its paged cache and
runs its prefill kernel over every page (`quest/models/QuestAttention.py`: `q_len > 1` -> `prefill_forward`), and its
evaluation script attends densely whenever q_len > 1. Only the following decode steps select pages. SCBench
(Li et al. 2024) evaluates Quest this way across turns. What a feed reads is the ledger's `feed_bytes`.

Deviations and switches:
- `keep_last=false` is the evaluation script's rule: the top `max(3, budget // page_size)` pages compete, the newest
  page included, and none is forced.
- GQA: each query head picks its own pages over its KV head's keys, as the evaluation script (it repeats K/V per
  query head); the kernels support MHA only.
- The evaluation script numbers layers from a global counter that starts at 32 (right for 32-layer models only);
  kvbench skips the first `dense_layers` layers of any model.
- Real memory: the full cache stays on the device (plus 2 x D per page and KV head of metadata); what Quest saves is
  reads, so each record's `transfers` reports the bytes each step reads (`read_bytes_per_step`: page metadata, page
  keys, page values; the dense layers' whole cache counted as pages read).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvbench.cache.kv_cache import KVCache
from kvbench.cache.ledger import StepStart, TransferLedger
from kvbench.cache.paged import READS, PagedLayer
from kvbench.methods.base import Kind, Method
from kvbench.registry import METHODS


@METHODS.register("quest")
@dataclass
class Quest(Method):
    page_size: int = 16  # tokens per page (the paper's chunk size)
    dense_layers: int = 2  # the first layers attend everything (the reference skips layers 0 and 1)
    keep_last: bool = True  # the newest page is always attended (kernels); false: it competes (evaluation script)

    kind: ClassVar[Kind] = Kind.STORAGE
    own_storage: ClassVar[bool] = True
    takes_chunks: ClassVar[bool] = True  # a fed question or turn joins the storage and attends it densely

    def __post_init__(self):
        for name in ("page_size", "dense_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (1 if name == "page_size" else 0):
                raise ValueError(f"quest: {name}={value!r} must be an integer >= {1 if name == 'page_size' else 0}")
        if not isinstance(self.keep_last, bool):
            raise ValueError(f"quest: keep_last={self.keep_last!r} must be true or false")

    def check_budget(self, budget: int | None) -> None:
        super().check_budget(budget)
        if budget < self.page_size:
            raise ValueError(f"quest: budget={budget} must be at least one page (page_size={self.page_size})")

    def attach(self, cache: KVCache, capture, budget: int) -> TransferLedger:
        """Turn every prefilled layer into a paged layer (the first `dense_layers` without selection) and open a
        ledger entry at each decode step. Returns the ledger of bytes read."""
        ledger = TransferLedger(READS)
        layers = cache.layers
        for i, layer in enumerate(layers):
            if i in capture.window_layers:  # a sliding-window layer keeps the model's own window semantics
                continue
            pages = None if i < self.dense_layers else budget // self.page_size
            layers[i] = PagedLayer.from_layer(layer, self.page_size, pages, ledger, self.keep_last)
        capture.input_hook = StepStart(layers, ledger)
        capture.cache = cache
        return ledger
