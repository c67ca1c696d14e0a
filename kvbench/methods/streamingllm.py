"""StreamingLLM (Xiao et al., arXiv 2309.17453): attention sinks + the most recent tokens.

Applied once after prefill, as the KV papers' baselines do (PyramidKV's LongBench script: 4 sinks + B - 4 recent;
kvpress `StreamingLLMPress(n_sink=4)`). Positions are kept as original (no re-rotation), matching those baselines.
Quirk: PyramidKV's NIAH script used window 32, i.e. B - 32 *first* tokens + 32 recent; set `n_sink=B-32` for that.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvbench.methods.base import LayerView, Method
from kvbench.registry import METHODS


@METHODS.register("streamingllm")
@dataclass
class StreamingLLM(Method):
    n_sink: int = 4  # initial tokens always kept (the attention sinks); counted inside the budget

    def __post_init__(self):
        if self.n_sink < 0:
            raise ValueError(f"streamingllm: n_sink={self.n_sink} must be >= 0")

    def check_budget(self, budget: int | None) -> None:
        super().check_budget(budget)
        if budget <= self.n_sink:
            raise ValueError(f"streamingllm: budget={budget} must be > n_sink={self.n_sink} (sinks count inside "
                             "the budget); raise budget or lower method.n_sink.")

    def select(self, view: LayerView, n_keep: int) -> Tensor:
        b, h_kv, n = view.keys.shape[:3]
        idx = torch.cat([torch.arange(self.n_sink), torch.arange(n - (n_keep - self.n_sink), n)])
        return idx.to(view.keys.device).expand(b, h_kv, n_keep)
