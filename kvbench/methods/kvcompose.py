r"""KVCompose (arXiv 2509.05165): structured compression with composite tokens, scored by replaying the context.
Reference code: NVIDIA/kvpress 0.5.5 `kvpress/presses/kvcompose_press.py: KVComposePress` (the authors' own
contribution to kvpress; no separate repository of theirs was found).

1. After the prefill the whole context is fed once more on top of the full cache (positions n..2n-1; the engine's
   `generation.reconstruct`, as KVzip's repeat but with no prompt around it), and its K/V is dropped again.
2. In every layer each query head's replay rows take a softmax over the n context keys and their own (causal); an
   entry scores the max over rows (`agg_task`), then the mean over its KV group's heads (`agg_group`), then, with
   `add_mean_across_heads`, plus the layer's mean over KV heads.
3. `structured=true` (the default): each head's scores, sorted, form a curve; a layer's composite curve is their
   mean over heads (`agg_head`), layer 0's is the max over all layers' curves ("the first layer is the largest");
   one top-(budget x layers) over every layer's curve gives each layer its count, at least 1 (or
   `keep_token_lower_bound`). Every head of a layer then keeps that many entries, each its own top ones: a
   "composite token" is the i-th kept entry of every head, of different original positions, so the layer stays a
   dense `[B, H, k]` tensor of a per-layer length (PyramidKV's layout).
   `structured=false`: one top-(budget x layers x heads) over every head's curve gives per-head counts, stored per
   head for real (`kvbench.cache.varlen`, Ada-KV's); kvpress only masks those.

Budget: `budget=B` keeps B x layers entries per head in all (structured; the floor of 1 per layer may add some) or
B x layers x heads (not structured), the mean over layers and heads B; kvpress keeps int(L n (1 - ratio)), the same
where n (1 - ratio) is a whole number. Equal to KVComposePress's kept sets on the embedded model
(tests/unit/test_kvcompose.py, goldens by scripts/make_kvpress_goldens_scorers3.py).
Not implemented: `add_v_norm` (off in kvpress; the reconstruction scorer is not handed the values) and
`register_prompt_ids` (a replay of other prompts than the context: kvpress's pipeline never calls it).
Cost: one more prefill of the context over twice its length; the K/V held at the peak is 2x the full cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import Tensor

from kvbench.methods.base import Kind, Method
from kvbench.registry import METHODS

Agg = Literal["max", "mean"]


def aggregate(x: Tensor, dim: int, how: Agg) -> Tensor:
    return x.amax(dim) if how == "max" else x.mean(dim)


@METHODS.register("kvcompose")
@dataclass
class KVCompose(Method):
    kind: ClassVar[Kind] = Kind.RECONSTRUCTOR

    structured: bool = True  # false: per-head counts, heads of different lengths (kvpress: masked)
    agg_task: Agg = "max"  # over the replay rows
    agg_group: Agg = "mean"  # over the query heads of a KV group
    agg_head: Agg = "mean"  # over the KV heads' sorted curves: the layer's composite curve (structured)
    add_mean_across_heads: bool = True  # each head's scores + the layer's mean over KV heads
    keep_token_lower_bound: int = 0  # entries every layer (structured) / head curve keeps first
    row_block: ClassVar[int] = 512  # replay rows scored at once

    def __post_init__(self):
        for field in ("agg_task", "agg_group", "agg_head"):
            if getattr(self, field) not in ("max", "mean"):
                raise ValueError(f"kvcompose: {field}={getattr(self, field)!r} is not one of max, mean")
        if self.keep_token_lower_bound < 0:
            raise ValueError(f"kvcompose: keep_token_lower_bound={self.keep_token_lower_bound} must be >= 0")

    @property
    def own_storage(self) -> bool:  # per-head lengths only when not structured
        return not self.structured

    def reconstruction_inputs(self, context_ids: Tensor) -> list[tuple[int, int, Tensor]]:
        """One replay: the whole context, scoring every entry."""
        return [(0, context_ids.shape[1], context_ids)]

    def chunk_scores(self, query: Tensor, key: Tensor, scaling: float, start: int, end: int,
                     softcap: float | None = None) -> Tensor:
        """`[B, H_kv, n]`: the replay rows `query` `[B, H_q, q, D]` over `key` `[B, H_kv, n + q, D]` (the context,
        then the replay's own keys, causal), fp32; `agg_task` over rows, `agg_group` over each group's heads."""
        b, h_q, q, d = query.shape
        h_kv, n = key.shape[1], end - start
        keys = key.float()[:, :, None]
        grouped = query.float().view(b, h_kv, h_q // h_kv, q, d)
        acc = keys.new_full((b, h_kv, h_q // h_kv, n), float("-inf") if self.agg_task == "max" else 0.0)
        for row in range(0, q, self.row_block):
            rows = grouped[:, :, :, row:row + self.row_block]
            logits = rows @ keys.transpose(-1, -2) * scaling  # [B, H_kv, G, r, n + q]
            if softcap is not None:
                logits = softcap * torch.tanh(logits / softcap)
            future = torch.arange(q, device=key.device)[None] > torch.arange(row, row + rows.shape[3],
                                                                             device=key.device)[:, None]
            logits[..., n:] = logits[..., n:].masked_fill(future, float("-inf"))
            probs = logits.softmax(dim=-1)[..., :n]
            acc = torch.maximum(acc, probs.amax(3)) if self.agg_task == "max" else acc + probs.sum(3)
        acc = acc if self.agg_task == "max" else acc / q
        return aggregate(acc, 2, self.agg_group)

    def select_all(self, scores: dict[int, Tensor], budget: int) -> dict[int, Tensor | list[Tensor]]:
        """Per layer: `[1, H, k_layer]` (structured) or one index tensor per head (not); empty when all fits."""
        if not scores:
            return {}
        layers = sorted(scores)
        if scores[layers[0]].shape[0] != 1:
            raise ValueError("kvcompose: the counts across layers are chosen per prompt; it needs batch size 1")
        stacked = torch.stack([scores[i][0] for i in layers]).float()  # [L, H, n]
        if self.add_mean_across_heads:
            stacked = stacked + stacked.mean(dim=1, keepdim=True)
        n_layers, n_heads, n = stacked.shape
        curves = stacked.sort(dim=-1, descending=True).values  # [L, H, n]: each head's scores by rank
        lower = self.keep_token_lower_bound
        order = stacked.argsort(dim=-1, descending=True)
        if self.structured:
            layer_curves = aggregate(curves, 1, self.agg_head)  # [L, n]
            layer_curves[:, :lower] += 1e9
            layer_curves[0] = layer_curves.max(dim=0).values
            total = budget * n_layers
            if total >= layer_curves.numel():
                return {}
            counts = torch.bincount(layer_curves.flatten().topk(total).indices // n, minlength=n_layers)
            counts = counts.clamp(min=max(1, lower)).tolist()
            return {i: order[k, :, :counts[k]].sort(dim=-1).values[None] for k, i in enumerate(layers)}
        curves[..., :lower] += 1e9
        total = budget * n_layers * n_heads
        if total >= curves.numel():
            return {}
        counts = torch.bincount(curves.flatten().topk(total).indices // n, minlength=n_layers * n_heads)
        counts = counts.view(n_layers, n_heads).tolist()
        return {i: [order[k, h, :counts[k][h]].sort().values for h in range(n_heads)] for k, i in enumerate(layers)}
