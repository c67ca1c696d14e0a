"""Keyformer (Adnan et al., MLSys 2024). Reference code: d-matrix-ai/keyformer-llm @ f327831 (MPT path).

The eviction score is a Gumbel-perturbed softmax of the attention logits, softmax((x + g) / tau) with fresh standard
Gumbel noise g per element and per step, and tau rising linearly from tau_init at prefill to tau_end over the
generation (tau_t = tau_init + t (tau_end - tau_init) / max_new_tokens). Scores accumulate per layer and head from the
whole prompt (column sums) and every decode step. The cache holds k = budget entries: the last w = int(k *
recent_ratio) plus the k - w best "key tokens". The attention itself stays a plain softmax.

Temperature of a fed chunk (a `query=agnostic` question, a conversation's later turn, scored as prefill rows by
`EvictionState.chunk`): the schedule's tau at the decode steps so far, t = `state.step` (k after k steps; tau_init
right after the prompt). Eq. 10 defines tau per decoding iteration, and §3.3.1 raises it "as more tokens are
discarded": a chunk after k steps faces the cache those k steps left, so it takes the temperature in force there.
The released code has no such chunk: any multi-token forward restarts everything as a new prompt
(mpt-keyformer-lib/attention.py L102-117: score_fn, discard mask and itr_count reset, so tau = tau_init at L141),
and its conversation task generates once from the first turn (conversation/dialogue.py L328-346, `if j == 0`).
t stops at T (tau_end) when a conversation decodes more than T = max_new_tokens steps in all: Eq. 10 spans
[tau_init, tau_end] ("we define a range for tau"); past T the paper says nothing.

Selection rules:
- `paper` (default): the token leaving the recent window competes with the key tokens on accumulated score (§3.4).
- `code_frozen`: the released code's off-by-one: the boundary token is dropped unscored (at prefill, position
  n - w - 1; at each step, the entry that just left the window), so the key set chosen at prefill never changes.
  Use it to rebuild the paper's tables. On a prompt that fits the budget (no prefill eviction; the code's padding
  to 1920 made this case impossible there) the key set is chosen by score at the layer's first eviction, the entry
  leaving the window competing (the paper rule, once), and frozen from then on.
Budget: `budget` entries, or `budget_fraction` of the prompt length (the paper's "% of prompt"). `padded_length=1920`
takes the fraction of 1920 instead, the base of the released runs (every prompt left-padded to 1920 tokens:
k = int(1920 * fraction), e.g. 1152 at 60 %, whatever the article's length). Noise is seeded per sample (run `seed`) and drawn on the model's
device (CPU and CUDA draw different numbers from the same seed).
`logit_adjustment` is Table 4's ablation: `gumbel` (the method), `gaussian` (noise of the Gumbel's mean 0.5772 and
std 1.2825), `constant` (c = 0.5772 on every logit: softmax is shift-invariant, so only the temperature acts) or
`none` (plain softmax(x / tau); the paper's "None" column is H2O in the same framework: method=h2o).
Scores are fp32 (the code used bf16). GQA: scores averaged over each KV group's query heads.
`score=shared` is Table 3's "shared score function" row (Keyformer (Org Pos), Shared), which the released code does
not have; this is a RECONSTRUCTION of the paper's words (Sec. 4.4.1), labelled as such: one
(KV head x entry) accumulator summed over all layers, head index aligned ("a single global score function for all
decoder layers, with accumulation across decoder layers and decoding stages"), so every layer keeps the same entries
per head. The selection rule is applied once to that sum: after the prefill of every layer, and at each decode step
after the last layer's attention, to all layers at once (a mask computed after the last layer, applied at
the next step: the next step attends the evicted cache). Because all layers keep the same entries, the sum of the
per-layer accumulated scores is that accumulator, so beams reorder it with the per-layer scores. Sliding-window
layers (Gemma 2/3) keep their own window and are left out of the sum.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from kvbench.methods.decoding import DecodingMethod, EvictionState, heavy_recent_keep
from kvbench.registry import METHODS


EULER_GAMMA = 0.5772  # the standard Gumbel's mean (Table 4's Gaussian mean and constant c)
GUMBEL_STD = 1.2825  # its standard deviation, pi / sqrt(6)
ADJUSTMENTS = ("gumbel", "gaussian", "constant", "none")
SCORES = ("per_layer", "shared")


@METHODS.register("keyformer")
@dataclass
class Keyformer(DecodingMethod):
    recent_ratio: float = 0.3  # w / k (the code's `recent` = 30 %)
    tau_init: float = 1.0
    tau_end: float = 2.0
    selection: Literal["paper", "code_frozen"] = "paper"
    budget_fraction: float | None = None  # k = int(prompt_len * fraction) instead of `budget`
    padded_length: int | None = None  # with budget_fraction: k = int(padded_length * fraction) (released runs: 1920)
    logit_adjustment: Literal["gumbel", "gaussian", "constant", "none"] = "gumbel"  # Table 4's score noise
    score: Literal["per_layer", "shared"] = "per_layer"  # shared: Table 3's row, a reconstruction

    def __post_init__(self):
        if not 0 <= self.recent_ratio < 1:
            raise ValueError(f"keyformer: recent_ratio={self.recent_ratio} must be in [0, 1)")
        if self.selection not in ("paper", "code_frozen"):
            raise ValueError(f"keyformer: selection={self.selection!r} is not one of paper, code_frozen")
        if self.tau_init <= 0 or self.tau_end <= 0:
            raise ValueError("keyformer: tau_init and tau_end must be > 0")
        if self.budget_fraction is not None and not 0 < self.budget_fraction <= 1:
            raise ValueError(f"keyformer: budget_fraction={self.budget_fraction} must be in (0, 1]")
        if self.padded_length is not None and (self.budget_fraction is None or self.padded_length < 1):
            raise ValueError(f"keyformer: padded_length={self.padded_length} needs budget_fraction and must be >= 1")
        if self.logit_adjustment not in ADJUSTMENTS:
            raise ValueError(f"keyformer: logit_adjustment={self.logit_adjustment!r} is not one of "
                             f"{', '.join(ADJUSTMENTS)}")
        if self.score not in SCORES:
            raise ValueError(f"keyformer: score={self.score!r} is not one of {', '.join(SCORES)}")

    def check_budget(self, budget: int | None) -> None:
        if self.budget_fraction is None:
            super().check_budget(budget)

    def start(self, prompt_len: int, budget: int, max_new_tokens: int, seed: int) -> EvictionState:
        if self.budget_fraction is not None:
            base = self.padded_length if self.padded_length is not None else prompt_len
            budget = max(1, math.floor(base * self.budget_fraction + 1e-9))  # int(n * pct / 100) of the code
        return super().start(prompt_len, budget, max_new_tokens, seed)

    def tau(self, state: EvictionState) -> float:
        """Eq. 10 at t = the decode steps so far (`state.step`): tau_init at prefill, tau_init + t (tau_end -
        tau_init) / T at the t-th step, and for a chunk fed after k steps (a later turn) the temperature in force
        at step k. t stops at T = max_new_tokens, so tau stays in the paper's range [tau_init, tau_end] when a
        conversation decodes more than T steps in all."""
        t = min(state.step, max(state.max_new_tokens, 1))
        return self.tau_init + t * (self.tau_end - self.tau_init) / max(state.max_new_tokens, 1)

    def noise(self, logits: Tensor, state: EvictionState) -> Tensor | float:
        """The logit adjustment added before the tempered softmax, drawn where the logits live."""
        if self.logit_adjustment in ("none", "constant"):
            return 0.0 if self.logit_adjustment == "none" else EULER_GAMMA
        draw = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        gen = state.generator_on(logits.device)
        if self.logit_adjustment == "gaussian":
            return draw.normal_(EULER_GAMMA, GUMBEL_STD, generator=gen)
        return -draw.exponential_(generator=gen).log()  # standard Gumbel

    def row_score(self, logits: Tensor, state: EvictionState | None, decoding: bool) -> Tensor:
        return ((logits + self.noise(logits, state)) / self.tau(state)).softmax(dim=-1)

    def evict(self, state: EvictionState, layer_idx: int, scores: Tensor, prefill: bool) -> Tensor | None:
        if self.score == "per_layer":
            return self.keep_rule(state, layer_idx, scores, prefill)
        if prefill or layer_idx != max(state.scores):  # shared: wait for the step's last scored layer
            return None
        return self.shared_keep(state, prefill=False, scored_now=layer_idx)

    def after_prefill(self, state: EvictionState) -> None:
        if self.score == "shared" and state.scores:
            self.shared_keep(state, prefill=True)

    def shared_keep(self, state: EvictionState, prefill: bool, scored_now: int | None = None) -> Tensor | None:
        """The selection rule on the sum over layers; applied to every scored layer except `scored_now` (whose
        eviction the state applies with the returned indices)."""
        layers = sorted(state.scores)
        total = torch.stack([state.scores[i] for i in layers]).sum(dim=0)
        idx = self.keep_rule(state, layers[0], total, prefill)  # the rule's own state lives with the first layer
        if idx is not None:
            for i in layers:
                if i != scored_now:
                    state.apply(i, idx)
        return idx

    def keep_rule(self, state: EvictionState, layer_idx: int, scores: Tensor, prefill: bool) -> Tensor | None:
        """Indices to keep under `selection` (paper / code_frozen), from scores `[B, H_kv, n]`."""
        k = state.budget
        w = int(k * self.recent_ratio)
        if self.selection == "paper":
            return heavy_recent_keep(scores, k, w)
        n = scores.shape[-1]
        if n <= k:
            return None
        b, h, _ = scores.shape
        chosen = state.extra[layer_idx].get("key_set_chosen", False)
        state.extra[layer_idx]["key_set_chosen"] = True
        if prefill:  # key tokens from [0, n - w - 1): the boundary entry n - w - 1 is never scored
            keys = scores[..., : n - w - 1].topk(k - w, dim=-1).indices.sort(dim=-1).values
        elif not chosen:  # the prompt fit the budget: choose the key set by score once, boundary entry competing
            return heavy_recent_keep(scores, k, w)
        else:  # drop the entry that just left the window; everything older is the frozen key set
            keys = torch.arange(n - w - 1, device=scores.device).expand(b, h, n - w - 1)
        recent = torch.arange(n - w, n, device=scores.device).expand(b, h, w)
        return torch.cat([keys, recent], dim=-1)
