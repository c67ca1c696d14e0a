"""CAPKV (arXiv 2604.25975): capacity-aware retention, query-weighted leverage of the values. Reference: NVIDIA/kvpress
0.5.5 `CapPress` (the authors' code was not read here).

Per query head, a historical-query anchor mu is the mean of the prompt's pre-RoPE queries after the `n_sink` sinks,
rotated by the average RoPE matrix of the next `n_future_positions` positions (Expected Attention's rotation). Each
entry i (after the sinks) weighs w_i = exp(tau (cos(mu, k_i) - max_j cos(mu, k_j))) (k_i: its cached, post-RoPE key),
and scores s_i = w_i v_i^T A^-1 v_i with A = I + sum_j (w_j + epsilon) v_j v_j^T (the capacity matrix of the values;
fp32 solve). Scores are averaged over the query heads of each KV group; the sinks score the layer's maximum + 1 (kept,
inside the budget); the top `budget` per KV head are kept.

kvpress's deviations from the paper, kept here (its docstring): keys and anchor L2-normalised (cosine, the paper uses
raw dot products), the per-head max shift before exp, the averaged future RoPE rotation, u_i = v_i, sinks at max + 1
(the paper: max). Needs every prompt query (`[B, H_q, n, D]` held per layer until it is compressed, as
non_causal_attn). The model must have a rotary encoding. Prefill only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from kvbench.methods.base import LayerView, Method, reduce_groups
from kvbench.methods.non_causal_attn import EVERY_QUERY
from kvbench.registry import METHODS


def query_anchor(view: LayerView, n_sink: int, n_future: int) -> Tensor:
    """`[B, H_q, D]` fp32: the mean pre-RoPE query after the sinks, times the average future RoPE matrix (R mu)."""
    n, d = view.prompt_len, view.keys.shape[-1]
    if view.rotary is None:
        raise ValueError(f"cap: the capture recorded no rotary encoding for layer {view.layer_idx}; this model "
                         "family's attention gives no (cos, sin) to read")
    if view.window_queries is None or view.window_queries.shape[2] < n:
        got = 0 if view.window_queries is None else view.window_queries.shape[2]
        raise ValueError(f"cap: scoring needs every prompt query ({n}), the view has {got}; it runs at prefill only")
    queries = view.rotary.unrotate(view.window_queries[:, :, -n:][:, :, n_sink:], torch.arange(n_sink, n))
    rotation = view.rotary.matrix(torch.arange(n, n + n_future), d, mean=True).to(queries.device)
    return queries.float().mean(dim=2) @ rotation.T


def capacity_scores(anchor: Tensor, keys: Tensor, values: Tensor, tau: float, epsilon: float) -> Tensor:
    """Anchor `[B, H_q, D]`, keys and values `[B, H_kv, T, D]` -> `[B, H_q, T]`: w_i v_i^T (I + sum w v v^T)^-1 v_i."""
    b, h_q, d = anchor.shape
    h_kv = keys.shape[1]
    grouped = F.normalize(anchor, dim=-1).view(b, h_kv, h_q // h_kv, d)
    cosine = torch.einsum("bhgd,bhtd->bhgt", grouped, F.normalize(keys.float(), dim=-1)).clamp(-1.0, 1.0)
    logits = tau * cosine
    weights = torch.exp(logits - logits.amax(dim=-1, keepdim=True))  # [B, H_kv, g, T]
    v = values.float()  # [B, H_kv, T, D]: each query head's u_i is its group's value
    capacity = torch.eye(d, device=v.device) + torch.einsum("bhgt,bhtd,bhte->bhgde", weights + epsilon, v, v)
    v_t = v.transpose(-1, -2)[:, :, None]  # [B, H_kv, 1, D, T]: broadcast over the group's query heads
    leverage = (v_t * torch.linalg.solve(capacity, v_t)).sum(dim=-2)  # [B, H_kv, g, T]
    return (weights * leverage).reshape(b, h_q, -1)


@METHODS.register("cap")
@dataclass
class Cap(Method):
    reads_per_head: ClassVar[frozenset[str]] = frozenset({"rotary angles"})  # (MLA: refused)
    prefill_needs: ClassVar[str | None] = "every prompt query"  # (its anchor averages them)
    tau: float = 5.0  # temperature of the query-key alignment weights
    n_future_positions: int = 512  # future positions averaged into the anchor's RoPE rotation
    n_sink: int = 4  # first entries always kept (max + 1), left out of the anchor and the capacity matrix
    epsilon: float = 1e-6

    def __post_init__(self):
        if self.tau <= 0:
            raise ValueError(f"cap: tau={self.tau} must be > 0")
        if self.n_future_positions < 1:
            raise ValueError(f"cap: n_future_positions={self.n_future_positions} must be >= 1")
        if self.n_sink < 0:
            raise ValueError(f"cap: n_sink={self.n_sink} must be >= 0")
        if self.epsilon < 0:
            raise ValueError(f"cap: epsilon={self.epsilon} must be >= 0")

    @property
    def query_window(self) -> int:
        return EVERY_QUERY  # the anchor averages every query after the sinks

    def check_budget(self, budget: int | None) -> None:
        super().check_budget(budget)
        self.check_below_budget("n_sink", budget, "sinks count inside the budget")

    def scores(self, view: LayerView) -> Tensor:
        """`[B, H_kv, n]` fp32, the sinks at the maximum + 1."""
        anchor = query_anchor(view, self.n_sink, self.n_future_positions)
        keys, values = view.keys[:, :, self.n_sink:], view.values[:, :, self.n_sink:]
        scores = reduce_groups(capacity_scores(anchor, keys, values, self.tau, self.epsilon), keys.shape[1], "mean")
        return F.pad(scores, (self.n_sink, 0), value=float(scores.max()) + 1)

    def select(self, view: LayerView, n_keep: int) -> Tensor:
        return self.scores(view).topk(n_keep, dim=-1).indices.sort(dim=-1).values
