"""StreamingLLM (Xiao et al., arXiv 2309.17453): attention sinks + the most recent tokens.

Applied once after prefill, as the KV papers' baselines do (PyramidKV's LongBench script: 4 sinks + B - 4 recent;
kvpress `StreamingLLMPress(n_sink=4)`). Positions are kept as original (no re-rotation), matching those baselines.
`recent=r` is the other split: the last r tokens and the first B - r (PyramidKV's paper text, §5.1.3: "the last
alpha tokens and the first k - alpha", r = alpha = 8; its NIAH script's window 32 is the same split with r = 32).
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
    recent: int | None = None  # instead of n_sink: keep the last `recent` tokens and the first B - recent

    def __post_init__(self):
        if self.n_sink < 0:
            raise ValueError(f"streamingllm: n_sink={self.n_sink} must be >= 0")
        if self.recent is not None and self.recent < 1:
            raise ValueError(f"streamingllm: recent={self.recent} must be >= 1 (or null: n_sink sinks + recent rest)")

    @property
    def kept_window(self) -> int:
        return self.recent or 0  # (n_sink sinks + the rest recent: how many are recent depends on n_keep)

    def check_budget(self, budget: int | None) -> None:
        super().check_budget(budget)
        if self.recent is not None and budget <= self.recent:
            raise ValueError(f"streamingllm: budget={budget} must be > recent={self.recent} (the first B - recent "
                             "tokens are kept too); raise budget or lower method.recent.")
        if self.recent is None and budget <= self.n_sink:
            raise ValueError(f"streamingllm: budget={budget} must be > n_sink={self.n_sink} (sinks count inside "
                             "the budget); raise budget or lower method.n_sink.")

    def select(self, view: LayerView, n_keep: int) -> Tensor:
        b, h_kv, n = view.keys.shape[:3]
        first = n_keep - self.recent if self.recent is not None else self.n_sink
        idx = torch.cat([torch.arange(first), torch.arange(n - (n_keep - first), n)])
        return idx.to(view.keys.device).expand(b, h_kv, n_keep)
