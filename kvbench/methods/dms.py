"""DMS, as kvpress runs it (`DMSPress`, kvpress @ 8bb29b9 `kvpress/presses/dms_press.py`; Łańcucki et al., "Inference-
Time Hyper-Scaling with KV Cache Compression", arXiv 2506.05345): a score threshold instead of a budget.

Every prompt entry gets a score from its own token alone (a scorer of the new tokens: here Knorm's -‖k‖, kvpress
`DMSPress(KnormPress())`; `kvzap` is the same rule over KVzap's learned scores). Entries outside the last `window`
prompt positions whose score is below `threshold` are evicted, in every layer and KV head independently, right after
the layer's prefill attention; the window is always kept, nothing else is protected (no sinks). So the heads keep
different numbers of entries, stored per head for real (Ada-KV's `kvbench.cache.varlen`; kvpress masks them), and
**the compression ratio is an outcome, not a setting**: `budget` is ignored and `ratio` refused (kvpress: "compression
ratio cannot be set"); the records' `effective_budget` and `kv_bytes` say what was kept.

Not implemented: kvpress's `decoding=True` (the same rule applied to each generated token as it leaves the window):
kvbench's per-head variable layers are not evicted from while decoding yet (the decoded tokens sit in a dense part,
one per head per step), so the generated tokens are all kept, as kvpress's default (`decoding=False`) does. Neither is
the paper's trained DMS (the evictor learned into the model, delayed eviction): kvpress's press is a proxy of it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from kvbench.methods.base import LayerView, Method
from kvbench.registry import METHODS


@METHODS.register("dms")
@dataclass
class DMS(Method):
    threshold: float = -17.0  # below it, outside the window, evicted (-‖k‖: about half on the embedded model)
    window: int = 128  # the last prompt positions, never evicted (kvpress sliding_window_size)

    threshold_budget: ClassVar[bool] = True

    def __post_init__(self):
        if self.window < 1:
            raise ValueError(f"{self.registry_name}: window={self.window} must be >= 1 (kvpress's "
                             "sliding_window_size: the last prompt positions kept)")

    @property
    def kept_window(self) -> int:
        return self.window

    def check_budget(self, budget: int | None) -> None:
        """The kept count follows `threshold`: any budget is accepted and ignored."""

    def layer_budgets(self, prompt_len: int, n_layers: int, budget: int | None) -> list[int]:
        """Below the prompt's length whenever entries lie outside the window, so that `select` runs (the per-head
        lists it returns decide what is kept)."""
        return [prompt_len - 1 if prompt_len > self.window else prompt_len] * n_layers

    def scores(self, view: LayerView) -> Tensor:
        """Per-entry scores `[B, H_kv, n]` from each token alone: Knorm's -‖k‖ (fp32)."""
        return -view.keys.float().norm(dim=-1)

    def select(self, view: LayerView, n_keep: int) -> list[Tensor]:
        """Each KV head's entries outside the window scoring at least `threshold`, then the window (batch 1)."""
        scores, n = self.scores(view), view.prompt_len
        if scores.shape[0] != 1:
            raise ValueError(f"{self.registry_name}: per-head variable lengths need batch size 1")
        outside = n - min(self.window, n)
        recent = torch.arange(outside, n, device=scores.device)
        return [torch.cat([(head[:outside] >= self.threshold).nonzero().flatten(), recent]) for head in scores[0]]
