"""Random eviction: kvpress's `RandomPress` baseline (NVIDIA/kvpress 0.5.5 `presses/random_press.py`).

Each layer keeps `budget` entries per KV head chosen uniformly at random, nothing protected: the floor any scorer
should beat. As kvpress with a seed, the draw is `torch.rand` from a generator seeded with `seed` for every layer (so
every layer draws the same scores and keeps the same positions at the same prompt length), in the keys' dtype, and
the top `budget` draws are kept. Unlike kvpress, kvbench always seeds (kvpress's default `seed=None` draws from the
global generator: not reproducible), and draws each batch row alone, so a sample keeps the same entries in a batch
as alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvbench.methods.base import LayerView, Method
from kvbench.registry import METHODS


@METHODS.register("random")
@dataclass
class Random(Method):
    seed: int = 0  # the generator's seed, the same in every layer (kvpress `RandomPress(seed=...)`)

    def __post_init__(self):
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"random: seed={self.seed!r} must be an integer >= 0")

    def scores(self, view: LayerView) -> Tensor:
        """Uniform draws `[B, H_kv, n]`: each batch row from a generator seeded with `seed` (kvpress's draw at B=1)."""
        keys = view.keys
        rows = []
        for _ in range(keys.shape[0]):
            gen = torch.Generator(device=keys.device).manual_seed(self.seed)
            rows.append(torch.rand(1, *keys.shape[1:-1], generator=gen, device=keys.device, dtype=keys.dtype))
        return torch.cat(rows)

    def select(self, view: LayerView, n_keep: int) -> Tensor:
        return self.scores(view).topk(n_keep, dim=-1).indices.sort(dim=-1).values
