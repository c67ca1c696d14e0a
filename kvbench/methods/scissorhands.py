"""Scissorhands (Liu et al., NeurIPS 2023, "Scissorhands: Exploiting the Persistence of Importance Hypothesis for LLM
KV Cache Compression at Test Time"). Reference code: Zefan-Cai/KVCache-Factory `pyramidkv/scissorhands.py` @ c97f9d7
(`reduce_scissorhands_scores`, `update_scissorhands_importance`, `select_scissorhands_tokens`).

Persistence of importance: an entry that was attended to in the past will be attended to again. Each entry's
importance is the attention it received, summed over the last `history_window` query rows of each update (all rows
when null) and accumulated across updates with a `decay` (importance = decay * importance + new rows' sums): at
prefill over the prompt's rows, at each decode step over the new token's row. After prefill and after every decode
step, each layer and KV head keeps its first `sink_size` and last `recent_size` entries plus the top
(budget - protected) of the others by importance (`selection=topk`), or that many drawn without replacement with
probabilities softmax(importance / random_temperature) (`selection=prob`, the paper's probabilistic variant; uniform
when random_temperature <= 0) from the sample's seeded generator. The cache never holds more than `budget` entries
per head after a step; evicted entries are freed (`layer.keep`).

Defaults are the reference's (no sinks, no recent window, all rows, no decay). GQA: each row's attention is averaged
over the query heads of a KV group (`gqa_reduce`) before it accumulates. Where the reference takes one caller
generator, kvbench draws from each sample's own (seeded by the run's seed), heads in order, so a batch draws as alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from kvbench.methods.decoding import DecodingMethod, EvictionState
from kvbench.registry import METHODS

SELECTIONS = ("topk", "prob")


@METHODS.register("scissorhands")
@dataclass
class Scissorhands(DecodingMethod):
    history_window: int | None = None  # last query rows of each update whose attention counts; null: all
    decay: float = 1.0  # importance kept from earlier updates (1: plain sums, as H2O)
    recent_size: int = 0  # last entries always kept, inside the budget
    sink_size: int = 0  # first entries always kept, inside the budget
    selection: Literal["topk", "prob"] = "topk"  # prob: drawn with probabilities softmax(importance / temperature)
    random_temperature: float = 1.0  # selection=prob: the weights' temperature; <= 0: uniform

    def __post_init__(self):
        if self.history_window is not None and self.history_window < 1:
            raise ValueError(f"scissorhands: history_window={self.history_window} must be >= 1 or null (all rows)")
        if self.decay < 0:
            raise ValueError(f"scissorhands: decay={self.decay} must be >= 0")
        for field in ("recent_size", "sink_size"):
            if getattr(self, field) < 0:
                raise ValueError(f"scissorhands: {field}={getattr(self, field)} must be >= 0")
        if self.selection not in SELECTIONS:
            raise ValueError(f"scissorhands: selection={self.selection!r} is not one of {', '.join(SELECTIONS)}")

    @property
    def together(self) -> bool:  # a probabilistic draw reads each sample's own generator: one sample at a time
        return self.selection == "topk"

    def check_budget(self, budget: int | None) -> None:
        super().check_budget(budget)
        if self.recent_size + self.sink_size >= budget:
            raise ValueError(f"scissorhands: recent_size + sink_size = {self.recent_size + self.sink_size} must be "
                             f"< budget={budget}; lower method.recent_size or method.sink_size, or raise budget.")

    def row_score(self, logits: Tensor, state: EvictionState | None, decoding: bool) -> Tensor:
        """Softmax rows; with a history window, rows before the last `history_window` of an update score 0 (a row
        at position p sees key k - w iff p >= k - w, k the keys it is scored over)."""
        probs = logits.softmax(dim=-1)
        if self.history_window is None or decoding:
            return probs
        first = max(logits.shape[-1] - self.history_window, 0)
        return probs * torch.isfinite(logits[..., first:first + 1])

    def accumulate(self, old: Tensor, row: Tensor) -> Tensor:
        return old * self.decay + row if self.decay != 1.0 else old + row

    def evict(self, state: EvictionState, layer_idx: int, scores: Tensor, prefill: bool) -> Tensor | None:
        b, h, n = scores.shape
        if n <= state.budget:
            return None
        protected = torch.zeros(n, dtype=torch.bool, device=scores.device)
        protected[: self.sink_size] = True
        if self.recent_size:
            protected[n - self.recent_size:] = True
        count = state.budget - int(protected.sum())
        keep = protected.expand(b, h, n).clone()
        if self.selection == "topk":
            keep.scatter_(-1, scores.masked_fill(protected, float("-inf")).topk(count, dim=-1).indices, True)
        else:
            generator = state.generator_on(scores.device)
            left = (~protected).nonzero()[:, 0]
            for row in range(b):
                for head in range(h):
                    if self.random_temperature <= 0:
                        weights = torch.ones(left.numel(), device=scores.device)
                    else:
                        candidate = scores[row, head, left].float()
                        weights = ((candidate - candidate.max()) / self.random_temperature).softmax(dim=0)
                    picked = torch.multinomial(weights, count, replacement=False, generator=generator)
                    keep[row, head, left[picked]] = True
        return keep.nonzero()[:, 2].view(b, h, state.budget)
