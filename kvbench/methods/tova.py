"""TOVA (Oren et al., arXiv 2401.06104, "Transformers are Multi-State RNNs"). Reference code:
schwartz-lab-NLP/TOVA `src/tova_cache.py` @ 9c7d09b (`TOVACache.reduce`); kvpress `tova_press.py` @ 8bb29b9.

Token Omission Via Attention: the cache is a fixed-size multi-state. After prefill and after every decode step, when a
layer holds more than `budget` entries, it keeps the `budget` entries to which the CURRENT query pays the most
attention, and drops the rest. The score is the step's own softmax row, never accumulated (unlike H2O): at prefill
the last prompt query's attention over the whole prompt, at each decode step the new token's attention over the cache
(its own entry included), so each step evicts the lowest-attention entry. No recent window, no sinks.

Heads (`selection`):
- `layer` (default, the reference): the attention row is averaged over ALL query heads of the layer and one top-k
  set is kept for every KV head (`torch.mean(attn_weights[:, :, -1, :], dim=1)` on KV repeated per query head;
  kvpress does the same).
- `kv_head`: one set per KV head, the row averaged over that group's query heads (`gqa_reduce`): a GQA-native
  variant the reference does not have.
Differences from the reference, all small: probabilities stay fp32 (the reference averages them after casting to
the model dtype); kvpress additionally always keeps the last prompt token at prefill, TOVA does not and neither does
kvbench by default: `keep_last=true` is kvpress's `TOVAPress` (the last prompt entry kept, the other budget - 1 by
the row over the earlier keys), applied where kvbench evicts prefill-like (the prompt, a chunk fed on top), not at
decode steps (kvpress compresses only the prefill); with it the kept entries equal TOVAPress's
(tests/unit/test_kvpress_oracle.py). kvpress's TOVAPress also selects only once, after the prompt: the question
fed on top (`query=agnostic`) and the generated tokens stay; `prefill_only=true` does the same (no eviction after
the prompt's), for kvpress's leaderboard. The prefill row comes from the capture's chunked prefill scoring (cost as
H2O's), keeping only the last prompt query's row: the one row whose causal mask lets it see the last key.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import Tensor

from kvbench.methods.decoding import DecodingMethod, EvictionState
from kvbench.registry import METHODS

SELECTIONS = ("layer", "kv_head")


@METHODS.register("tova")
@dataclass
class TOVA(DecodingMethod):
    selection: Literal["layer", "kv_head"] = "layer"  # layer: one set from the all-head mean (the reference)
    keep_last: bool = False  # True: kvpress's TOVAPress, the last prompt entry always kept at prefill
    prefill_only: bool | None = None  # true: select once after the prompt, never while decoding (kvpress's
    #                                   TOVAPress); null/false: evict at every step (the reference)

    keeps_history: ClassVar[bool] = False  # each step's attention row replaces the scores
    static_rule: ClassVar[bool] = True  # tensor code reading only the budget: runs in the static step

    def __post_init__(self):
        if self.selection not in SELECTIONS:
            raise ValueError(f"tova: selection={self.selection!r} is not one of {', '.join(SELECTIONS)}")

    @property
    def evicts_while_decoding(self) -> bool:
        return not self.prefill_only

    def row_score(self, logits: Tensor, state: EvictionState | None, decoding: bool) -> Tensor:
        """The softmax row of the current query; at prefill only the prompt's last query counts (the only row not
        masked at the last key), so the column sums are exactly its row."""
        probs = logits.softmax(dim=-1)
        if decoding:
            return probs
        return probs * torch.isfinite(logits[..., -1:])

    def evict(self, state: EvictionState, layer_idx: int, scores: Tensor, prefill: bool) -> Tensor | None:
        b, h, n = scores.shape
        if n <= state.budget:
            return None
        if prefill and self.keep_last:  # kvpress: the last entry scores above every other
            scores = torch.cat([scores[..., :-1], scores.new_full((b, h, 1), float("inf"))], dim=-1)
        if self.selection == "layer":  # mean of the group means = mean over every query head (equal groups)
            keep = scores.mean(dim=1, keepdim=True).topk(state.budget, dim=-1).indices
            return keep.sort(dim=-1).values.expand(b, h, state.budget)
        return scores.topk(state.budget, dim=-1).indices.sort(dim=-1).values
