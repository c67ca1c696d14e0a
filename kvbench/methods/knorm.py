"""Knorm (Devoto et al., arXiv 2406.11430, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression"). Reference code: NVIDIA/kvpress `kvpress/presses/knorm_press.py` @ 8bb29b9 (`KnormPress`).

After prefill, each layer and KV head keeps the entries whose keys have the LOWEST L2 norm (low-norm keys draw high
attention, the paper's observation). kvpress scores `-keys.norm(dim=-1)` on the cached (post-RoPE) keys, per KV head,
and keeps the top `int(n * (1 - ratio))`; RoPE is a rotation, so the norm is the pre-RoPE one too. No queries, no
attention: it runs with any attention kernel and is question-agnostic by construction.

Window handling, in kvbench's budget terms (`budget` = entries kept per KV head per layer, window included):
- `recent=0` (default, kvpress): all `budget` entries are chosen by key norm; nothing is protected, not even the
  last prompt token.
- `recent=w`: the last `w` prompt positions are always kept and counted inside the budget (as SnapKV's window),
  the other `budget - w` by key norm: a switch for comparing with the window-scoring methods.
Norms are computed in fp32. No compression when the prompt is not longer than the budget.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kvbench.methods.base import LayerView, Method, topk_plus_window
from kvbench.registry import METHODS


@METHODS.register("knorm")
@dataclass
class Knorm(Method):
    recent: int = 0  # last prompt positions always kept, counted inside the budget (0: kvpress: none)

    def __post_init__(self):
        if self.recent < 0:
            raise ValueError(f"knorm: recent={self.recent} must be >= 0 (0: every kept entry chosen by key norm)")

    @property
    def kept_window(self) -> int:
        return self.recent

    def check_budget(self, budget: int | None) -> None:
        super().check_budget(budget)
        self.check_below_budget("recent", budget)

    def scores(self, view: LayerView) -> Tensor:
        """Negated key L2 norms `[B, H_kv, n]`, fp32: higher = keep."""
        return -view.keys.float().norm(dim=-1)

    def select(self, view: LayerView, n_keep: int) -> Tensor:
        scores = self.scores(view)
        if self.recent:
            return topk_plus_window(scores[..., : view.prompt_len - self.recent], n_keep, view.prompt_len,
                                    self.recent)
        return scores.topk(n_keep, dim=-1).indices.sort(dim=-1).values
