"""MiniCache (Liu et al., NeurIPS 2024, arXiv 2405.14366): KV cache compression in the depth dimension. Reference
code: Zefan-Cai/KVCache-Factory `pyramidkv/minicache.py` @ c97f9d7 (`minicache_slerp`,
`select_minicache_retention_indices`, `compress_minicache_pair`, `restore_minicache_pair`).

Adjacent layers of the model's middle-to-deep part hold similar KV states: from `start_layer` (null: the middle,
n_layers // 2, the paper's choice) the layers are paired (s, s+1), (s+2, s+3), ... and each pair's prompt K/V is
stored once (`kvbench.cache.merged_layers`): a SLERP-merged direction with interpolation `interpolation` (the paper's
t = 0.6), each layer's magnitudes, and the `retention_ratio` share of tokens whose directions disagree most kept whole
for both layers (the paper's retention of distinct tokens; 0.05 as the reference). Keys and values are merged and
retained each on their own, as the reference's functions are called on each. Nothing is evicted: every token stays,
and `budget` is ignored (recorded as given, as for `full`). Tokens generated or fed after the prompt stay full
precision in each layer (the reference merges a prompt's states; it has no decode path). Layers below the start, an
odd last layer and a model's sliding-window layers stay dense.

Composes with batching and the grid launcher (each sample's cache is merged on its own) and with `query=agnostic`
(the question joins each layer's dense part and attends the merged prompt); beam search and decode-time compression
refuse it in one line (its layers are not dense).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvbench.cache.kv_cache import KVCache
from kvbench.cache.merged_layers import merge_pair
from kvbench.methods.base import Kind, Method
from kvbench.registry import METHODS


@METHODS.register("minicache")
@dataclass
class MiniCache(Method):
    start_layer: int | None = None  # first merged layer; null: n_layers // 2 (the middle)
    interpolation: float = 0.6  # SLERP t: the deeper layer's weight (the paper's default)
    retention_ratio: float = 0.05  # share of each pair's tokens kept unmerged (largest angular distance)

    kind: ClassVar[Kind] = Kind.STORAGE
    own_storage: ClassVar[bool] = True
    takes_chunks: ClassVar[bool] = True  # a fed question joins each layer's dense part

    def __post_init__(self):
        if self.start_layer is not None and self.start_layer < 0:
            raise ValueError(f"minicache: start_layer={self.start_layer} must be >= 0 or null (the middle layer)")
        for field in ("interpolation", "retention_ratio"):
            if not 0 <= getattr(self, field) <= 1:
                raise ValueError(f"minicache: {field}={getattr(self, field)} must be in [0, 1]")

    def check_budget(self, budget: int | None) -> None:
        if budget is not None:  # ignored, but a nonsensical value is still a mistake worth reporting
            super().check_budget(budget)

    def pairs(self, n_layers: int, window_layers: frozenset[int] = frozenset()) -> list[tuple[int, int]]:
        """The merged (previous, current) layer pairs."""
        start = n_layers // 2 if self.start_layer is None else self.start_layer
        pairs = [(i, i + 1) for i in range(start, n_layers - 1, 2)]
        return [(a, b) for a, b in pairs if a not in window_layers and b not in window_layers]

    def attach(self, cache: KVCache, capture, budget: int | None) -> None:
        """Replace each pair of prefilled layers by the two halves of their merged storage."""
        layers = cache.layers
        for a, b in self.pairs(len(layers), frozenset(capture.window_layers)):
            layers[a], layers[b] = merge_pair(layers[a], layers[b], self.interpolation, self.retention_ratio)
        capture.cache = cache
        return None
