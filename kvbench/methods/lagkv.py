"""LagKV (Liang et al., arXiv 2504.04704, "LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are
Important"). References: the authors' AI-Lab-China-Merchants-Bank/LagKV @ 5b4f452 (`lag_kv.py`, a DynamicCache,
and its README) and NVIDIA/kvpress 0.5.5 `LagKVPress`; they score alike.

Attention-free. After the first `n_sink` entries the prompt is cut into partitions of `lag_size`; each partition is
scored against the next one (its "lag"): every key and value channel is min-max normalised by the next partition's
range, the standard deviation over channels is taken per token, and a softmax over the partition turns it into a
score; key and value scores are averaged. The sinks and the last (partial + one full) partition are always kept, as
kvpress scores them 1. Without `cross_scoring` the scores become ranks inside each partition (rank / `lag_size`), so
every partition offers its best tokens equally; `cross_scoring=true` keeps the softmax values (kvpress: for Ada-KV).
A prompt shorter than `n_sink + 2 lag_size` keeps the sinks and the most recent entries (kvpress's scores for it).
Then the top `budget` scores per KV head are kept (kvpress's top-k over the same scores: many ranks tie across
partitions, and which tied entry survives follows `topk`'s order, as in kvpress). Scores in fp32.

Defaults: 16 sinks, the authors' (`LagKV(sink_size=16)`; kvpress: `method.n_sink=4`), and partitions of 128, the
lag size of their README's prefill example and kvpress's (their class default is 1024). Where the authors' code
differs otherwise: it keeps int(ratio x lag_size) entries of every scored partition, the top by key score + value
score; kvbench's top-`budget` over the ranks is the same set when the budget left after the sinks and the tail
divides evenly among the partitions (else the remainder goes to the next rank in `topk`'s order, as kvpress). Its
cache also compresses again while decoding, each time the tail reaches two partitions beyond what was compressed;
kvbench compresses the prompt only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvbench.methods.base import LayerView, Method
from kvbench.registry import METHODS


def lag_scores(states: Tensor) -> Tensor:
    """`[B, H, P, L, D]` partitions -> `[B, H, P - 1, L]`: each partition's tokens against the next one's range."""
    ref, own = states[:, :, 1:], states[:, :, :-1]
    low, high = ref.amin(dim=-2, keepdim=True), ref.amax(dim=-2, keepdim=True)
    return ((own - low) / (high - low)).std(dim=-1).softmax(dim=-1)


@METHODS.register("lagkv")
@dataclass
class LagKV(Method):
    n_sink: int = 16  # first entries always kept (scored 1); the authors' default (kvpress: 4)
    lag_size: int = 128  # partition length; each partition is scored by the next one
    cross_scoring: bool = False  # keep the softmax scores instead of per-partition ranks (kvpress: for Ada-KV)

    def __post_init__(self):
        if self.n_sink < 0:
            raise ValueError(f"lagkv: n_sink={self.n_sink} must be >= 0")
        if self.lag_size < 2:
            raise ValueError(f"lagkv: lag_size={self.lag_size} must be >= 2 (a partition's range needs two tokens)")

    def scores(self, view: LayerView) -> Tensor:
        """`[B, H_kv, n]`, higher = keep; sinks and the tail score 1."""
        keys, values = view.keys.float(), view.values.float()
        b, h, n, d = keys.shape
        s, lag = self.n_sink, self.lag_size
        if n < s + 2 * lag:  # too short to partition: sinks (1), then rising with position (the most recent win)
            scores = torch.ones(b, h, n, device=keys.device)
            if n > s:
                scores[..., s:] = torch.arange(n - s, device=keys.device) / (n - s)
            return scores
        end = s + (n - s) // lag * lag
        parts = lambda x: x[:, :, s:end].reshape(b, h, -1, lag, d)  # noqa: E731
        scores = (lag_scores(parts(keys)) + lag_scores(parts(values))) / 2  # [B, H, P - 1, L]
        if not self.cross_scoring:
            scores = scores.argsort(dim=-1).argsort(dim=-1) / lag
        ones = lambda k: torch.ones(b, h, k, device=keys.device)  # noqa: E731
        return torch.cat([ones(s), scores.reshape(b, h, -1), ones(lag + n - end)], dim=-1)

    def select(self, view: LayerView, n_keep: int) -> Tensor:
        return self.scores(view).topk(n_keep, dim=-1).indices.sort(dim=-1).values
