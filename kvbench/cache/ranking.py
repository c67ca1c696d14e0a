"""Top-k with an explicit tie rule: the larger score first, and among equal scores the lower index first.

`torch.topk` leaves the order of tied scores to its algorithm, which depends on the length of the row (a partial
sort or a selection, by k and n), so the same scores padded to a static capacity can pick other tied entries.
PQCache's approximate scores tie often (keys with the same codes score the same: about half of the top-k cuts on
the tiny test model fall on a tie), so the retrieval layers rank with this rule both in the eager step
(`kvbench.cache.paged`, `kvbench.cache.pq_offloaded`) and in the static step (`kvbench.cache.static_retrieval`), and
select the same entries.
"""
from __future__ import annotations

import torch
from torch import Tensor


def top_first(scores: Tensor, k: int) -> Tensor:
    """Indices `[..., k]` of the `k` largest scores along the last dim, best first, ties to the lower index."""
    return scores.sort(dim=-1, descending=True, stable=True).indices[..., :k]


def ranks(scores: Tensor) -> Tensor:
    """Each entry's place `[...]` (0 = best) in the order of `top_first`: entry i is among the top k iff
    `ranks[i] < k`, with k a tensor per row where rows keep different counts (static shapes)."""
    order = scores.sort(dim=-1, descending=True, stable=True).indices
    places = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, places)
