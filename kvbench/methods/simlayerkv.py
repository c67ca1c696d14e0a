"""SimLayerKV (Zhang et al., arXiv 2410.13846, "SimLayerKV: A Simple Framework for Layer-Level KV Cache
Reduction"). Reference code: sail-sg/SimLayerKV @ 1fb6bda (`LongBench/SimLayerKV_llama.py`,
`SimLayerKV_attention_llama.py`, thresholds in `pred.py`); NVIDIA/kvpress 0.5.5 `SimLayerKVPress`.

A per-layer, all-or-nothing choice: a layer whose last query puts more than `lazy_threshold` of its attention (mean
over the query heads) on the first `n_sink` entries and the last `budget` entries is "lazy" and keeps only its sinks
and recent entries; every other layer keeps its whole cache. No per-head or per-entry scores.

- `budget` is the lazy layers' recent size, kvpress's `n_recent` (TailorKV Table 5: "threshold 0.9, lazy layers
  keep 1024 recent tokens" = `budget=1024`): a lazy layer keeps the `n_sink` sinks and the last `budget - n_last`
  prompt entries, so that with the first generated token it holds `n_sink + budget`, the authors'
  `cache[0:4] + cache[-1024:]` after their first decode step. The mean kept per layer (`effective_budget`) is what
  the choice gave; a prompt not longer than `n_sink + budget + n_last` is not compressed (kvpress).
- `lazy_threshold=null` (default): the model family's, from the authors' `pred.py` and kvpress's docstring: Llama 3
  0.9 (a Llama vocabulary of 128k), Llama 2 0.65 (32k), Mistral 0.8, Qwen 0.85; any other family gets Llama 3's 0.9
  (`prepare` says which in manifest.json).
- `reading=authors` (default): the authors decide at the first decode step from the new token's attention over the
  cache, its own key among the recent ones; at prefill kvbench takes the last prompt query, its own key counted in
  the recent `budget`. `reading=kvpress`: SimLayerKVPress's sums, which leave the judging queries' own keys out (the
  recent `budget` entries before them). Both decide from `n_last` queries (the authors: 1).
- Compressed again while decoding (`decode_compression.target=T`; kvpress's DecodingPress takes ScorerPresses only,
  not SimLayerKVPress): `T` means what `budget` means, the lazy layers' recent size. Each compression judges the
  layer anew from the last `n_last` generated queries; a lazy layer is brought back to `n_sink + T - n_last`
  entries, so it holds at most `n_sink + T - n_last + every` (not the other methods' `T + every`), and a non-lazy
  layer keeps everything and grows with every token (`may_keep_whole`: in a batch its layers stay out of the
  fixed-capacity rows).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import Tensor

from kvbench.methods.base import LayerView, Method, window_attention
from kvbench.registry import METHODS

FAMILY_THRESHOLDS = {"llama3": 0.9, "llama2": 0.65, "mistral": 0.8, "qwen": 0.85}  # pred.py; kvpress's docstring


def family_of(config) -> str:
    """The authors' model families from a config: Llama 3 / Llama 2 by vocabulary, Mistral, Qwen; '' otherwise."""
    kind = getattr(config, "model_type", "")
    if kind == "llama":
        return {128256: "llama3", 32000: "llama2"}.get(getattr(config, "vocab_size", 0), "")
    return "qwen" if kind.startswith("qwen") else ("mistral" if kind == "mistral" else "")


@METHODS.register("simlayerkv")
@dataclass
class SimLayerKV(Method):
    lazy_threshold: float | None = None  # attention mass above which a layer is lazy; null: the model family's
    n_sink: int = 4  # first entries a lazy layer keeps
    n_last: int = 1  # last prompt queries that judge each layer (kvpress `n_last`; the authors: the first new token)
    reading: Literal["authors", "kvpress"] = "authors"  # kvpress: the judging queries' own keys left out
    may_keep_whole: ClassVar[bool] = True  # a non-lazy layer keeps everything, while decoding too

    def __post_init__(self):
        if self.lazy_threshold is not None and not 0 <= self.lazy_threshold <= 1:
            raise ValueError(f"simlayerkv: lazy_threshold={self.lazy_threshold} must be in [0, 1] (or null)")
        self.threshold = 0.9 if self.lazy_threshold is None else self.lazy_threshold

    @property
    def query_window(self) -> int:
        return self.n_last

    def prepare(self, model, tokenizer, *, prefill=None) -> dict:
        family = family_of(model.config.get_text_config())
        if self.lazy_threshold is None:
            self.threshold = FAMILY_THRESHOLDS.get(family, 0.9)
        return {"lazy_threshold": self.threshold, "family": family or "other (Llama 3's threshold)"}

    def check_budget(self, budget: int | None) -> None:
        super().check_budget(budget)
        if budget <= self.n_last:
            raise ValueError(f"simlayerkv: budget={budget} (the lazy layers' recent entries) must be above "
                             f"n_last={self.n_last}")

    def layer_budgets(self, prompt_len: int, n_layers: int, budget: int) -> list[int]:
        """A lazy layer's count: sinks + recent. `select` keeps non-lazy layers whole (it returns None)."""
        if prompt_len <= self.n_sink + budget + self.n_last:
            return [prompt_len] * n_layers
        return [self.n_sink + budget - self.n_last] * n_layers

    def lazy_mass(self, view: LayerView, recent: int) -> float:
        """The judging queries' attention on the sinks and the last `recent` keys, mean over batch, heads, rows."""
        attn = window_attention(view.window_queries[:, :, -self.n_last:], view.keys, view.scaling,
                                view.window_bias, view.softcap, view.sinks).mean(dim=(0, 1, 2))  # [n]
        if self.reading == "kvpress":
            attn = attn[: view.prompt_len - self.n_last]
        return float(attn[: self.n_sink].sum() + attn[-recent:].sum())

    def select(self, view: LayerView, n_keep: int) -> Tensor | None:
        n, recent = view.prompt_len, n_keep - self.n_sink + self.n_last
        if self.lazy_mass(view, recent) <= self.threshold:
            return None  # not lazy: the layer keeps everything
        kept = torch.cat([torch.arange(self.n_sink), torch.arange(n - (n_keep - self.n_sink), n)])
        return kept.to(view.keys.device).expand(*view.keys.shape[:2], n_keep)
