"""H2O (Zhang et al., arXiv 2306.14048): heavy hitters by accumulated attention + the most recent tokens.
Reference code: FMInference/H2O `utils_real_drop/modify_llama.py` (`H2OKVCache_LayerWise`, physical eviction).

Scores are the attention each entry has received, summed over every query since it entered the cache: the column
sums of the causal prefill attention (all prompt queries, computed in chunks), then each decode step's row. After
prefill and after every decode step, each layer and KV head keeps the last `recent` entries plus the top
(budget - recent) of the others; the entry leaving the recent window competes with the heavy hitters. The cache never
holds more than `budget` entries per head after a step.

Variants (`variant`):
- `decode` (default): the above, H2O's own algorithm.
- `kvcache_factory`: the "H2O" rows of the PyramidKV and Ada-KV tables, as Zefan-Cai/KVCache-Factory
  `H2OKVCluster.update_kv` (@ffac160) computes them: one selection after prefill, no decode-time eviction. Scores are
  the softmax attention of ALL prompt queries over all n keys with only the trailing `recent_size` x `recent_size`
  block causally masked (earlier queries also see later keys: the code's mask), summed over the queries, restricted
  to the non-window keys, no pooling; top (budget - w) plus the last w. `granularity="query_head"` selects per
  query head on KV repeated to the query heads (the code's layout; H_q heads cached); `kv_head` reduces the scores
  over each KV group first (`gqa_reduce`). Window `recent_size`: 8 on LongBench, 32 on NIAH (PyramidKV's scripts).
  No compression when the prompt is not longer than the budget.
- `prefill_only`: one selection after prefill by full-causal column sums averaged over each KV group, then the
  cache grows (KVCache-Factory's 2026 HEAD scoring with kvbench's GQA reduction).
- `recent_ratio=0.5`: H2O's own default splits the budget equally (hh_size = recent_size); Keyformer's tables used
  0.3. `recent_size` sets it in entries instead.
- `normalize="observed"` (with `variant=prefill_only`): kvpress's `ObservedAttentionPress`: each key's column sum
  divided by the number of prompt queries that saw it (n - j for key j under the causal mask), per query head,
  before the group mean; with `recent_size=0` the kept entries equal ObservedAttentionPress's (kvpress computes
  them from eager attention; tests/unit/test_kvpress_oracle.py). Default `none`: H2O's plain sums, which favour
  early keys (seen by more queries).
- GQA: probabilities are averaged over the query heads of each KV group (`gqa_reduce`); H2O itself is MHA-only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import Tensor

from kvbench.methods.decoding import DecodingMethod, EvictionState, heavy_recent_keep
from kvbench.registry import METHODS

VARIANTS = ("decode", "prefill_only", "kvcache_factory")
NORMALIZE = ("none", "observed")


@METHODS.register("h2o")
@dataclass
class H2O(DecodingMethod):
    recent_ratio: float = 0.5  # share of the budget kept for the most recent entries
    recent_size: int | None = None  # absolute recent window (overrides recent_ratio)
    variant: Literal["decode", "prefill_only", "kvcache_factory"] = "decode"
    granularity: Literal["kv_head", "query_head"] = "kv_head"  # query_head: kvcache_factory only
    normalize: Literal["none", "observed"] = "none"  # observed: sums / queries that saw each key (prefill_only)

    together: ClassVar[bool] = True  # softmax rows and a top-k by budget: samples of one budget evict in one call
    static_rule: ClassVar[bool] = True  # tensor code reading only the budget: runs in the static step

    def __post_init__(self):
        if not 0 <= self.recent_ratio < 1:
            raise ValueError(f"h2o: recent_ratio={self.recent_ratio} must be in [0, 1)")
        if self.variant not in VARIANTS:
            raise ValueError(f"h2o: variant={self.variant!r} is not one of {', '.join(VARIANTS)}")
        if self.granularity not in ("kv_head", "query_head"):
            raise ValueError(f"h2o: granularity={self.granularity!r} is not one of kv_head, query_head")
        if self.granularity == "query_head" and self.variant != "kvcache_factory":
            raise ValueError("h2o: granularity=query_head needs variant=kvcache_factory (a one-shot selection)")
        if self.normalize not in NORMALIZE:
            raise ValueError(f"h2o: normalize={self.normalize!r} is not one of {', '.join(NORMALIZE)}")
        if self.normalize == "observed" and self.variant != "prefill_only":
            raise ValueError("h2o: normalize=observed needs variant=prefill_only (kvpress's one-shot "
                             "ObservedAttentionPress, causal prompt rows)")

    @property
    def evicts_while_decoding(self) -> bool:
        return self.variant == "decode"

    def recent(self, budget: int) -> int:
        return self.recent_size if self.recent_size is not None else int(budget * self.recent_ratio)

    def check_budget(self, budget: int | None) -> None:
        super().check_budget(budget)
        if self.recent(budget) >= budget:
            raise ValueError(f"h2o: recent_size={self.recent(budget)} must be < budget={budget}; "
                             "lower method.recent_size or raise budget.")

    def causal_block(self, budget: int) -> int | None:
        return self.recent(budget) if self.variant == "kvcache_factory" else None

    def prefill_scores(self, column_sums: Tensor, n_kv_heads: int) -> Tensor:
        if self.normalize == "observed":  # key j was seen by the n - j prompt queries at or after it
            n = column_sums.shape[-1]
            column_sums = column_sums / torch.arange(n, 0, -1, device=column_sums.device, dtype=column_sums.dtype)
        if self.granularity == "query_head":
            return column_sums  # one selection per query head; the cache then holds H_q heads
        return super().prefill_scores(column_sums, n_kv_heads)

    def evict(self, state: EvictionState, layer_idx: int, scores: Tensor, prefill: bool) -> Tensor | None:
        return heavy_recent_keep(scores, state.budget, self.recent(state.budget))
