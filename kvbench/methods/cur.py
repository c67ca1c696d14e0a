"""CurDKV (Sengupta et al., arXiv 2509.15038, "Value-Guided KV Compression for LLMs via Approximated CUR
Decomposition"). Reference: NVIDIA/kvpress 0.5.5 `CURPress` (the authors' code was not read here).

Attention-free leverage proxies: a key's (value's) score is its squared L2 norm, normalised to sum 1 inside each
local window of `local_window` consecutive entries (CUR's local approximation; the last window is padded with
zeros), and `leverage` combines them: `kv_product` (default) k2 * v2, `kv_avg` (k2 + v2) / 2, `key` or `value`
alone; the result is normalised over the sequence and the first `n_sink` entries are set to 1 (kept). With
`random_leverage=true` keys and values are first multiplied by a Gaussian sketch `[D, 20]` / √20 (kvpress draws it
unseeded; kvbench from a generator seeded with `seed`, one per layer); `local_approximation=false` uses the raw
squared norms. The top `budget` per KV head are kept. Scores in fp32 on the cached (post-RoPE) keys, as kvpress.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from kvbench.methods.base import LayerView, Method
from kvbench.registry import METHODS

LEVERAGES = ("kv_product", "kv_avg", "key", "value")
SKETCH = 20  # kvpress's sketch width


def local_normalise(x: Tensor, window: int) -> Tensor:
    """`[B, H, n]` divided by its sum inside each run of `window` entries (zero-padded at the end)."""
    b, h, n = x.shape
    blocks = F.pad(x, (0, (window - n % window) % window)).reshape(b, h, -1, window)
    return (blocks / blocks.sum(dim=-1, keepdim=True)).reshape(b, h, -1)[..., :n]


@METHODS.register("cur")
@dataclass
class CUR(Method):
    n_sink: int = 4  # first entries always kept
    leverage: Literal["kv_product", "kv_avg", "key", "value"] = "kv_product"
    local_approximation: bool = True  # normalise the squared norms inside local windows
    local_window: int = 16
    random_leverage: bool = False  # project keys and values on a seeded Gaussian sketch first
    seed: int = 0  # the sketch's seed (layer i draws from seed + i)

    def __post_init__(self):
        if self.leverage not in LEVERAGES:
            raise ValueError(f"cur: leverage={self.leverage!r} is not one of {', '.join(LEVERAGES)}")
        for field in ("n_sink", "seed"):
            if getattr(self, field) < 0:
                raise ValueError(f"cur: {field}={getattr(self, field)} must be >= 0")
        if self.local_window < 1:
            raise ValueError(f"cur: local_window={self.local_window} must be >= 1")

    def scores(self, view: LayerView) -> Tensor:
        """`[B, H_kv, n]`, higher = keep; the sinks score 1."""
        keys, values = view.keys.float(), view.values.float()
        if self.random_leverage:
            gen = torch.Generator(device=keys.device).manual_seed(self.seed + view.layer_idx)
            sketch = torch.randn(keys.shape[-1], SKETCH, generator=gen, device=keys.device) / math.sqrt(SKETCH)
            keys, values = keys @ sketch, values @ sketch
        k2, v2 = keys.pow(2).sum(dim=-1), values.pow(2).sum(dim=-1)
        if self.local_approximation:
            k2, v2 = local_normalise(k2, self.local_window), local_normalise(v2, self.local_window)
        scores = {"key": lambda: k2, "value": lambda: v2, "kv_avg": lambda: (k2 + v2) / 2,
                  "kv_product": lambda: k2 * v2}[self.leverage]()
        scores = scores / scores.sum(dim=-1, keepdim=True)
        scores[..., : self.n_sink] = 1.0
        return scores

    def select(self, view: LayerView, n_keep: int) -> Tensor:
        return self.scores(view).topk(n_keep, dim=-1).indices.sort(dim=-1).values
