"""H2O (Zhang et al., arXiv 2306.14048): heavy hitters by accumulated attention + the most recent tokens.
Reference code: FMInference/H2O `utils_real_drop/modify_llama.py` (`H2OKVCache_LayerWise`, physical eviction).

Scores are the attention each entry has received, summed over every query since it entered the cache: the column
sums of the causal prefill attention (all prompt queries, computed in chunks), then each decode step's row. After
prefill and after every decode step, each layer and KV head keeps the last `recent` entries plus the top
(budget - recent) of the others; the entry leaving the recent window competes with the heavy hitters. The cache never
holds more than `budget` entries per head after a step.

Defaults and switches:
- `recent_ratio=0.5`: H2O's own default splits the budget equally (hh_size = recent_size); Keyformer's tables used
  0.3. `recent_size` sets it in entries instead.
- `variant="prefill_only"` is KVCache-Factory's "H2O" (what the PyramidKV/Ada-KV tables call H2O): one selection
  after prefill by full-causal column sums, window `recent_size` (8 on LongBench, 32 on NIAH), then the cache grows.
- GQA: probabilities are averaged over the query heads of each KV group (`gqa_reduce`); H2O itself is MHA-only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import Tensor

from kvbench.methods.decoding import DecodingMethod, EvictionState, heavy_recent_keep
from kvbench.registry import METHODS


@METHODS.register("h2o")
@dataclass
class H2O(DecodingMethod):
    recent_ratio: float = 0.5  # share of the budget kept for the most recent entries
    recent_size: int | None = None  # absolute recent window (overrides recent_ratio)
    variant: Literal["decode", "prefill_only"] = "decode"

    def __post_init__(self):
        if not 0 <= self.recent_ratio < 1:
            raise ValueError(f"h2o: recent_ratio={self.recent_ratio} must be in [0, 1)")
        if self.variant not in ("decode", "prefill_only"):
            raise ValueError(f"h2o: variant={self.variant!r} is not one of decode, prefill_only")

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

    def evict(self, state: EvictionState, layer_idx: int, scores: Tensor, prefill: bool) -> Tensor | None:
        return heavy_recent_keep(scores, state.budget, self.recent(state.budget))
