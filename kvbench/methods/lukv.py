"""LU-KV (arXiv 2602.08585, "Predicting Future Utility: Global Combinatorial Optimization for Task-Agnostic KV Cache
Eviction"): a scorer's top entries per KV head, with a precomputed budget per (layer, KV head). Reference: kvpress
0.5.5 `LUKVPress` (`LUKVPress(ExpectedAttentionPress(epsilon=2e-2), sink=4, window=1)`); the authors' repository
(baidu-baige/LU-KV) could not be read here.

A budget curve `[99, layers, H_kv]` gives, for each target compression ratio 1 %..99 %, each head's prune ratio.
For a layer of n entries at ratio r (kvbench: r = 1 - budget / n; index round(100 r) - 1, clamped to 0..98) each
head's ideal keep count is (1 - its prune ratio) n; the layer keeps round(their sum) (at least one per head, at most
all), floors each head's count and hands the remainder to the largest fractional parts (kvpress's rule). Each head
then keeps its top count by Expected Attention (this class's parent: its fields, `epsilon` 0.02 as kvpress's
default scorer), the first `sink` and last `recent` entries forced to the top (stable order among equals). Heads hold
different lengths for real (per-head storage); kvpress masks. The mean kept per head follows the curve, not exactly
`budget`: the recorded effective budget says what was kept.

Curves (`curve`): `auto` reads the published one for Llama-3.1-8B-Instruct (GitHub raw file, LU-KV's
`evaluation/curve_data/llama-3.1-8b/ea_0.02_sink4_win1_llama_avg_ratio.npy`; its commit must be given,
`method.revision`, as kvpress follows `main`); a path reads a .npy (`allow_pickle=False`); `uniform` gives every
head the same ratio (Expected Attention with the sink and recent entries protected; also what a run through the
engine without `prepare` gets). None is made for the embedded model: LU-KV's curve generation (its step1/step2
scripts, per-context scorer statistics) was not available here. The default statistics window covers the whole
prompt (kvpress's Expected Attention); see `expected_attention` for the other fields.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

import kvbench.methods.artefacts as artefacts
from kvbench.methods.base import LayerView
from kvbench.methods.expected_attention import ExpectedAttention
from kvbench.registry import METHODS

REPO = "baidu-baige/LU-KV"
CURVES = {  # (kvpress BUDGET_CURVE_URLS, ExpectedAttentionPress(epsilon=2e-2), sink 4, window 1)
    "meta-llama/Llama-3.1-8B-Instruct": "evaluation/curve_data/llama-3.1-8b/ea_0.02_sink4_win1_llama_avg_ratio.npy",
}


def head_counts(prune_ratios: Tensor, n: int) -> Tensor:
    """kvpress's per-head keep counts `[H]` (int64) from a layer's prune ratios `[H]` and its n entries."""
    heads = prune_ratios.shape[0]
    ideal = (1.0 - prune_ratios.float()).clamp(0.0, 1.0) * n
    target = max(heads, min(heads * n, int(torch.round(ideal.sum()).item())))
    counts = torch.floor(ideal).long()
    remainder = target - int(counts.sum().item())
    if remainder > 0:
        counts[torch.topk(ideal - counts, k=min(remainder, heads)).indices] += 1
    return counts.clamp(min=1, max=n)


@METHODS.register("lukv")
@dataclass
class LUKV(ExpectedAttention):
    own_storage: ClassVar[bool] = True  # per-head variable layers
    window: int = 1 << 20  # prompt queries for Expected Attention's statistics (kvpress: every one after the sinks)
    epsilon: float = 0.02
    curve: str = "auto"  # auto | uniform | <path to a .npy [99, layers, H_kv] of prune ratios>
    revision: str | None = None  # the LU-KV commit the published curve is read at (auto)
    sink: int = 4  # first entries forced into every head's selection (kvpress `sink`)
    recent: int = 1  # last entries forced into every head's selection (kvpress `window`)
    curves = None  # `[99, layers, H_kv]` once `prepare` read them (not a config field)

    def __post_init__(self):
        super().__post_init__()
        artefacts.check_source("lukv", "curve", self.curve, ("auto", "uniform"))
        if self.sink < 0 or self.recent < 0:
            raise ValueError(f"lukv: sink={self.sink} and recent={self.recent} must be >= 0")

    def prepare(self, model, tokenizer, *, prefill=None) -> dict:
        info = super().prepare(model, tokenizer, prefill=prefill)  # Expected Attention's statistics, if any
        if self.curve == "uniform":
            return {**info, "curve": "uniform"}

        def published(name):
            path = CURVES.get(name)
            return artefacts.github_file(REPO, self.revision, path, "lukv") if path else None

        path = artefacts.resolve("lukv", self.curve, model, artefacts.embedded_file("lukv", "npy"), published)
        if not path.is_file():
            raise ValueError(f"lukv: no budget curve for this model ({path.name} missing); give one "
                             "(method.curve=<file.npy>) or use method.curve=uniform")
        self.curves = artefacts.read_npy(path)
        layers, _, h_kv, _ = artefacts.model_shape(model)
        artefacts.check_shape("lukv", str(path), self.curves.shape, (99, layers, h_kv))
        return {**info, "curve": artefacts.describe(path), "revision": self.revision}

    def prune_ratios(self, view: LayerView, n_keep: int) -> Tensor:
        """This layer's per-head prune ratios `[H_kv]` at the target ratio 1 - n_keep / n."""
        n, h_kv = view.prompt_len, view.keys.shape[1]
        ratio = 1 - n_keep / n
        if self.curves is None:
            if self.curve == "auto":
                artefacts.warn_unprepared(self, "a uniform curve")
            return torch.full((h_kv,), ratio)
        target = max(0, min(98, int(round(ratio * 100)) - 1))
        return torch.as_tensor(self.curves[target, view.layer_idx], dtype=torch.float32)

    def select(self, view: LayerView, n_keep: int) -> list[Tensor]:
        if view.keys.shape[0] != 1:
            raise ValueError("lukv: per-head variable lengths need batch size 1")
        scores = self.scores(view)[0]  # [H_kv, n]
        n = scores.shape[-1]
        top = scores.max() + 1
        scores[:, :min(self.sink, n)] = top
        if self.recent:
            scores[:, max(0, n - self.recent):] = top
        counts = head_counts(self.prune_ratios(view, n_keep), n).tolist()
        order = torch.argsort(scores, dim=-1, descending=True, stable=True)
        return [order[h, :c].sort().values for h, c in enumerate(counts)]
