"""R-KV (Cai et al., arXiv 2505.24133): redundancy-aware eviction for reasoning models, which repeat themselves.
Reference code: Zefan-Cai/R-KV (`rkv/compression/r1_kv.py` `R1KV.update_kv`, `rkv/utils.py`, `run_math.py`).

A layer at or over its budget keeps `budget - window` entries by `λ · importance - (1 - λ) · redundancy`, plus
its newest `window` entries:
- importance: the last `window` queries' logits over the older keys, each KV head taking the MAX over its query
  heads' logits (`compute_attention_scores(pooling="max")`), softmax over those keys (fp32, no causal mask: every
  older key precedes the window), mean over the window rows, max-pooled by `kernel`;
- redundancy: per KV head, the cosine similarity of every pair of keys (diagonal 0); for each key the most recent
  other key more similar than `threshold` (0.5) has its similarity to it zeroed (`retain_direction="last"`: the
  newest copy is spared), then each key's mean similarity to all keys, softmaxed over the keys.
Defaults as the reference: window 8, kernel 7, λ 0.07 (`run_math.py --mix_lambda`), threshold 0.5. It compresses
while decoding too: every `divide_length` (128) tokens of the sequence (prompt included, `divide_method=
step_length`) the layer is brought back to the budget, so a layer holds at most budget + 128 entries: unless
`decode_compression.target` says otherwise, `method=rkv budget=B` runs `decode_compression.every=128, target=B`
counted over the sequence (`own_decode_compression`): the step after the one whose sequence length was a multiple
of 128 (`CausalLM_forward` sets the flag the next forward reads), attending the layer before it is compressed. Its
window's queries are the sequence's last `window`, as the reference's query cache: the prompt's last ones while
fewer were generated (a prompt within `window` tokens below a multiple of 128). The reference stores the kept
entries best first (`topk`'s order), then the window, then the tokens decoded since, and the next compression
max-pools and spares copies in that order: kvbench stores by position, so `select_ranked` scores the entries in
the reference's order from the ranking the last selection left (`KVCache.ranked`). tests/unit/test_rkv_decode.py
checks both against the reference run on a tiny Llama. Not matched: a layer holding exactly `budget` entries at a
compression is re-ranked there by the reference (nothing evicted) and left in position order here.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from kvbench.methods.base import LayerView, Method, topk_plus_window
from kvbench.registry import METHODS


@METHODS.register("rkv")
@dataclass
class RKV(Method):
    window: int = 8  # the last queries that score importance; the newest entries, always kept
    kernel: int = 7
    mix_lambda: float = 0.07  # λ: importance's weight; 1 - λ: redundancy's
    threshold: float = 0.5  # cosine similarity above which two keys count as copies
    retain_direction: Literal["last", "first"] = "last"  # which similar key keeps its full similarity weight
    divide_length: int = 128  # compress every this many tokens of the sequence while decoding
    holds_ranked: ClassVar[bool] = True  # the reference stores its kept entries best first (`select_ranked`)

    @property
    def query_window(self) -> int:
        return self.window

    @property
    def kept_window(self) -> int:
        return self.window

    def __post_init__(self):
        if self.window < 1 or self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"rkv: window={self.window} must be >= 1 and kernel={self.kernel} odd and >= 1")
        if not 0 <= self.mix_lambda <= 1:
            raise ValueError(f"rkv: mix_lambda={self.mix_lambda} must be in [0, 1]")
        if self.retain_direction not in ("last", "first"):
            raise ValueError(f"rkv: retain_direction={self.retain_direction!r} is not one of last, first")
        if self.divide_length < 1:
            raise ValueError(f"rkv: divide_length={self.divide_length} must be >= 1")

    def check_budget(self, budget: int | None) -> None:
        super().check_budget(budget)
        self.check_below_budget("window", budget)

    def own_decode_compression(self, budget: int | None) -> tuple[int, int, str] | None:
        """(every, target, counted over): R-KV compresses while decoding by itself."""
        return (self.divide_length, budget, "sequence") if budget is not None else None

    def importance(self, view: LayerView) -> Tensor:
        """`[B, H_kv, n - window]`: pooled attention of the window over the older keys."""
        b, h_q, w, d = view.window_queries.shape
        keys, h_kv, n = view.keys, view.keys.shape[1], view.keys.shape[2]
        queries = view.window_queries[:, :, -self.window:].reshape(b, h_kv, h_q // h_kv, -1, d)
        logits = (queries @ keys[:, :, None].transpose(-1, -2)).amax(dim=2) * view.scaling  # [B, H_kv, w, n]
        attn = logits[..., : n - self.window].float().softmax(dim=-1).mean(dim=-2).to(keys.dtype)
        return F.max_pool1d(attn, self.kernel, stride=1, padding=self.kernel // 2)

    def redundancy(self, keys: Tensor) -> Tensor:
        """`[B, H_kv, n]`: each key's mean cosine similarity to the others, the newest similar copy spared."""
        unit = keys / (keys.norm(dim=-1, keepdim=True) + 1e-8)
        sim = unit @ unit.transpose(-1, -2)  # [B, H, n, n]
        n = sim.shape[-1]
        sim.diagonal(dim1=-2, dim2=-1).zero_()
        index = torch.arange(n, device=keys.device).expand_as(sim)
        similar = torch.where(sim > self.threshold, index, torch.zeros_like(index))
        spared = similar.amax(dim=-1) if self.retain_direction == "last" else similar.amin(dim=-1)
        sim.scatter_(-1, spared.unsqueeze(-1), 0.0)
        return sim.mean(dim=-2).softmax(dim=-1)

    def scores(self, view: LayerView) -> Tensor:
        n = view.keys.shape[-2]
        redundancy = self.redundancy(view.keys)[..., : n - self.window]
        return self.importance(view) * self.mix_lambda - redundancy * (1 - self.mix_lambda)

    def select(self, view: LayerView, n_keep: int) -> Tensor:
        return topk_plus_window(self.scores(view), n_keep, view.prompt_len, self.window)

    def select_ranked(self, view: LayerView, n_keep: int, positions: Tensor,
                      ranked: Tensor | None) -> tuple[Tensor, Tensor]:
        """`select` with the entries in the reference's cache order, where the pooling and the spared copy look:
        the last selection's top entries best first, then the others by position (kvbench stores all by position).
        Also returns the new top entries' positions, best first."""
        b, h, n = positions.shape
        order = held_order(positions, ranked)
        if ranked is not None:
            view = replace(view, keys=view.keys.gather(2, order[..., None].expand_as(view.keys)))
        top = order[..., : n - self.window].gather(-1, self.scores(view).topk(n_keep - self.window, dim=-1).indices)
        recent = torch.arange(n - self.window, n, device=top.device).expand(b, h, self.window)
        return torch.cat([top, recent], dim=-1).sort(dim=-1).values, positions.gather(-1, top)


def held_order(positions: Tensor, ranked: Tensor | None) -> Tensor:
    """`[B, H, n]` storage indices in the reference's order: the entries at `ranked`'s positions in its order, then
    the others by position."""
    b, h, n = positions.shape
    slots = torch.arange(n, device=positions.device).expand(b, h, n)
    if ranked is None:
        return slots
    k = ranked.shape[-1]
    rank = (slots + k).scatter(-1, torch.searchsorted(positions.contiguous(), ranked.contiguous()),
                               torch.arange(k, device=positions.device).expand(b, h, k))
    return rank.argsort(dim=-1)
