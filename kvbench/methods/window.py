"""Position-only policies that evict at every decode step: the local window and rolling StreamingLLM.

- `local`: the last `budget` entries, nothing else (BUZZ's "Local" baseline, Keyformer's "Window attention").
- `streamingllm_rolling`: `n_sink` attention sinks + the last `budget - n_sink` entries, re-applied after prefill and
  after every decode step, as the StreamingLLM paper runs it and as BUZZ's baselines do (JunqiZhao888/buzz-llm
  `StartRecentKVCache`). `streamingllm` is the prefill-once form of the KV papers' tables.
Both run through the decoding-method machinery (an eviction after prefill and after each step, `positions=shift`
re-rotation included) but need no attention scores, so no prefill column sums are computed for them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from kvbench.methods.decoding import DecodingMethod, EvictionState
from kvbench.registry import METHODS


@dataclass
class RollingWindow(DecodingMethod):
    """Keep the first `n_sink` and the most recent entries; the scores are never read."""

    n_sink: int = 0
    static_rule: ClassVar[bool] = True  # tensor code reading only the budget: runs in the static step

    accumulates_attention: ClassVar[bool] = False  # no column sums: selection is by position only

    def __post_init__(self):
        if self.n_sink < 0:
            raise ValueError(f"{self.registry_name}: n_sink={self.n_sink} must be >= 0")

    def check_budget(self, budget: int | None) -> None:
        super().check_budget(budget)
        if budget <= self.n_sink:
            raise ValueError(f"{self.registry_name}: budget={budget} must be > n_sink={self.n_sink} (sinks count "
                             "inside the budget); raise budget or lower method.n_sink.")

    def evict(self, state: EvictionState, layer_idx: int, scores: Tensor, prefill: bool) -> Tensor | None:
        b, h, n = scores.shape
        if n <= state.budget:
            return None
        recent = state.budget - self.n_sink
        dev = scores.device  # (made there: no host-to-device copy inside a captured step)
        idx = torch.cat([torch.arange(self.n_sink, device=dev), torch.arange(n - recent, n, device=dev)])
        return idx.expand(b, h, state.budget)


@METHODS.register("local")
@dataclass
class Local(RollingWindow):
    """The last `budget` entries after every step (no sinks)."""


@METHODS.register("streamingllm_rolling")
@dataclass
class RollingStreamingLLM(RollingWindow):
    """4 sinks + the last `budget - 4` entries after every step."""

    n_sink: int = 4
