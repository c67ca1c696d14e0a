"""SnapKV (Li et al., arXiv 2404.14469). Reference code: FasterDecoding/SnapKV, and its port in
Zefan-Cai/KVCache-Factory (`SnapKVCluster`, commit ffac160) that the PyramidKV and Ada-KV tables used.

After prefill, each layer keeps the `budget - window` prompt entries that the last `window` queries attend to most
(softmax over all keys in fp32, summed over the window rows, max-pooled with kernel 7), plus the window itself.
Defaults follow the reference scripts: window 32, max-pool 7. Quirks and their switches:
- `granularity="query_head"` reproduces the official code, which repeats KV per query head *before* selecting, so
  each query head keeps its own set and the cache holds H_q heads (n_rep x the memory). Default `kv_head`
  (GQA-native): scores are reduced over the query heads of a group (`gqa_reduce`, mean as KVCache-Factory's
  2026 `kv_head` mode) before pooling, and the cache holds H_kv heads.
- `pooling="avg", kernel=5` (with `window=64`) reproduces kvpress's `SnapKVPress` (which differs from the
  reference): the same kept entries (tests/unit/test_kvpress_oracle.py).
- PyramidKV's LongBench scripts used `window=8` for SnapKV; set `method.window=8` to rebuild those tables.
- No compression when the prompt is not longer than the budget (reference behaviour).
- `key_channels=r` adds ThinK (Xu et al., arXiv 2407.21018; kvpress `ThinKPress`, reviewed by ThinK's first author,
  composed after SnapKV as its docstring suggests: `ComposedPress([SnapKVPress(), ThinKPress()])`): after the
  selection each KV head keeps the D - int(D r) key channels with the highest mean(q²) x mean(k²), q over the last
  `channel_window` prompt queries (each group's query heads averaged), k over the kept keys; stored for real as
  `[B, H, T, D']` (kvbench/cache/channels.py; kvpress zeroes the channels and saves nothing). Keys of later tokens
  keep every channel, as kvpress. Also applied when the prompt fits the budget (kvpress's ThinK prunes regardless).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from kvbench.methods.base import LayerView, Method, pool1d, reduce_groups, topk_plus_window, window_attention
from kvbench.registry import METHODS

Granularity = Literal["kv_head", "query_head"]


@dataclass
class WindowScorer(Method):
    """Shared by SnapKV and PyramidKV: pooled window-attention scores and top-k selection (allocation differs)."""

    window: int = 32  # last prompt queries used for scoring; always kept; counted inside the budget
    kernel: int = 7
    pooling: Literal["max", "avg", "none"] = "max"
    granularity: Granularity = "kv_head"
    gqa_reduce: Literal["mean", "max", "sum"] = "mean"  # how query heads of a KV group are combined (kv_head)

    @property
    def query_window(self) -> int:
        return self.window  # the capture records the last `window` queries of the prompt

    @property
    def kept_window(self) -> int:
        return self.window  # and every head keeps their entries

    @property
    def selects_per_query_head(self) -> bool:
        return self.granularity == "query_head"

    def __post_init__(self):
        name = type(self).registry_name
        if self.window < 1:
            raise ValueError(f"{name}: window={self.window} must be >= 1")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"{name}: kernel={self.kernel} must be odd and >= 1 (length-preserving pooling)")
        for field, value, allowed in [("pooling", self.pooling, ("max", "avg", "none")),
                                      ("granularity", self.granularity, ("kv_head", "query_head")),
                                      ("gqa_reduce", self.gqa_reduce, ("mean", "max", "sum"))]:
            if value not in allowed:
                raise ValueError(f"{name}: {field}={value!r} is not one of {', '.join(allowed)}")

    def check_budget(self, budget: int | None) -> None:
        super().check_budget(budget)
        self.check_below_budget("window", budget)

    def scores(self, view: LayerView) -> Tensor:
        """Pooled attention the window pays each prefix position: `[B, H, n - window]` (H per `granularity`)."""
        attn = window_attention(view.window_queries[:, :, -self.window:], view.keys, view.scaling, view.window_bias,
                                view.softcap, view.sinks)
        prefix = attn[..., : view.prompt_len - self.window].sum(dim=2)  # [B, H_q, n - w]
        if self.granularity == "kv_head":
            prefix = reduce_groups(prefix, view.keys.shape[1], self.gqa_reduce)
        return pool1d(prefix, self.kernel, self.pooling)

    def select(self, view: LayerView, n_keep: int) -> Tensor:
        return topk_plus_window(self.scores(view), n_keep, view.prompt_len, self.window)


@METHODS.register("snapkv")
@dataclass
class SnapKV(WindowScorer):
    """Uniform budget: every layer keeps `budget` entries per head (`budget - window` selected + the window);
    `key_channels` > 0: ThinK's channel pruning after it."""

    key_channels: float = 0.0  # ThinK: share of each head's key channels pruned after the selection (0: off)
    channel_window: int = 32  # ThinK: last prompt queries scoring the channels (kvpress ThinKPress window_size)

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.key_channels < 1:
            raise ValueError(f"snapkv: key_channels={self.key_channels} must be in [0, 1) (share of key channels "
                             "pruned; 0: off)")
        if self.channel_window < 1:
            raise ValueError(f"snapkv: channel_window={self.channel_window} must be >= 1")
        if self.key_channels and self.granularity != "kv_head":
            raise ValueError("snapkv: key_channels runs with granularity=kv_head")

    @property
    def query_window(self) -> int:
        return max(self.window, self.channel_window if self.key_channels else 0)

    @property
    def prunes_channels(self) -> bool:
        return self.key_channels > 0

    def channels_to_keep(self, view: LayerView, keys: Tensor) -> Tensor:
        return think_channels(view.window_queries[:, :, -self.channel_window:], keys, self.key_channels)


def think_channels(queries: Tensor, keys: Tensor, pruned_share: float) -> Tensor:
    """ThinK's kept channels `[B, H_kv, D']` (sorted): all but the int(D r) lowest mean(q²) x mean(k²) per head,
    q `[B, H_q, w, D]` (each KV group's query heads averaged), k `[B, H_kv, T, D]`."""
    b, h_kv, _, d = keys.shape
    q_norm = queries.float().pow(2).mean(dim=2).view(b, h_kv, -1, d).mean(dim=2)
    scores = q_norm * keys.float().pow(2).mean(dim=2)  # [B, H_kv, D]
    pruned = scores.topk(int(d * pruned_share), dim=-1, largest=False).indices
    keep = torch.ones_like(scores, dtype=torch.bool).scatter_(-1, pruned, False)
    return keep.nonzero()[:, -1].view(b, h_kv, -1)
