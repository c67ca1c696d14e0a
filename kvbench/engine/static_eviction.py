"""Decode-time evictors inside the static step: each method's scoring and keep rule as tensor code of fixed shapes.

The eager engine (`kvbench.methods.decoding.EvictionState.decode`) scores a step's logits over the cache in cache
order and keeps indices of a shape that may change each step. Here the logits come over a row's slots `[R, H_q, C]`;
scores accumulate slot for slot, the rule reads them in cache order (slots sorted by position: `StaticRows.cache_order`)
and returns a keep mask in that order, mapped back to slots; rows holding no more than the rule allows keep
everything. What the eager rule keeps on the host (a step count, BUZZ's old-sample count, Keyformer's frozen key set)
lives on the device, per row and layer, and goes back to the sample's state when it leaves. What cannot be drawn
inside a graph with the sample's own generator (Keyformer's Gumbel noise) is drawn before the step, in the eager
order and shapes, into a buffer the step reads.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from kvbench.cache.static import StaticRows
from kvbench.methods.base import reduce_groups
from kvbench.methods.buzz import BUZZ
from kvbench.methods.decoding import EvictionState, heavy_recent_keep
from kvbench.methods.keyformer import Keyformer


def static_form(method) -> type[BudgetRule] | None:
    """The static form of an evictor, or None where it has none (`unsupported` names why)."""
    if isinstance(method, Keyformer):
        return KeyformerRule if method.score == "per_layer" else None
    if isinstance(method, BUZZ):
        return BuzzRule
    return BudgetRule if getattr(method, "static_rule", False) else None


def keep_mask(idx: Tensor, like: Tensor) -> Tensor:
    """Indices `[R, H, k]` -> a bool mask shaped as `like` `[R, H, C]`."""
    return torch.zeros(like.shape, dtype=torch.bool, device=like.device).scatter_(-1, idx, True)


class BudgetRule:
    """A rule reading of the state only its budget (H2O, TOVA, the rolling windows): the method's own `row_score`
    and `evict`, applied to a row once it holds budget + 1 entries, exactly the shape the eager step hands them."""

    def __init__(self, method, budget: int, rows: int, n_layers: int, query_heads: int, device: torch.device):
        self.method, self.budget = method, budget
        self.states: list[EvictionState | None] = [None] * rows
        self.n_layers, self.query_heads, self.device = n_layers, query_heads, device

    def capacity(self, state: EvictionState, entries: int) -> int:
        return max(state.budget, entries) + 1

    def join(self, row: int, state: EvictionState, layers: list) -> None:
        self.states[row] = state

    def leave(self, row: int, state: EvictionState) -> None:
        self.states[row] = None

    def before_step(self, rows: list[int], layers: list[StaticRows]) -> None:
        """Host-side preparation of the step's inputs, outside the captured graph: the samples' step counts (the
        eager step counts at layer 0, before scoring)."""
        for r in rows:
            self.states[r].step += 1

    def scale(self, layer_idx: int, rows: StaticRows, scaling: float) -> Tensor:
        """Each row's softmax scale `[R]`."""
        return torch.full((rows.keys.shape[0],), scaling, dtype=torch.float32, device=rows.keys.device)

    def row_score(self, layer_idx: int, logits: Tensor, order: Tensor) -> Tensor:
        """The step's logits `[R, H_q, C]` -> the score each slot gets `[R, H_q, C]` (`order`: the slots in cache
        order, `StaticRows.cache_order`)."""
        return self.method.row_score(logits[:, :, None], self.first_state(), decoding=True)[:, :, 0]

    def keep(self, layer_idx: int, scores: Tensor, count: Tensor) -> tuple[Tensor, Tensor]:
        """Scores in cache order `[R, H, C]` and entries held `[R, H]` -> (keep mask in cache order, rows to evict
        `[R, H, 1]`)."""
        idx = self.method.evict(self.first_state(), layer_idx, scores, prefill=False)
        return keep_mask(idx, scores), (count > self.budget)[..., None]

    def first_state(self) -> EvictionState:
        return next(s for s in self.states if s is not None)

    def __call__(self, layer_idx: int, rows: StaticRows, logits: Tensor) -> None:
        method, valid, order = self.method, rows.valid, rows.cache_order()
        row = reduce_groups(self.row_score(layer_idx, logits, order), valid.shape[1], method.gqa_reduce)
        scores = (method.accumulate(rows.scores, row) if method.keeps_history else row).masked_fill(~valid, 0.0)
        kept, over = self.keep(layer_idx, scores.gather(-1, order), valid.sum(dim=-1))
        in_slots = torch.zeros_like(valid).scatter_(-1, order, kept)
        valid = torch.where(over, in_slots & valid, valid)
        rows.valid.copy_(valid)
        rows.scores.copy_(scores.masked_fill(~valid, 0.0))


class KeyformerRule(BudgetRule):
    """Keyformer: softmax((logits + Gumbel noise) / tau_t), noise drawn before the step from each sample's generator
    as the eager step draws it (one `[1, H_q, 1, n]` draw per layer, n the entries the step attends), tau_t from the
    sample's step count; `paper` keeps H2O's rule, `code_frozen` drops the entry leaving the window once its key set
    is chosen."""

    def __init__(self, method, budget: int, rows: int, n_layers: int, query_heads: int, device: torch.device):
        super().__init__(method, budget, rows, n_layers, query_heads, device)
        self.tau = torch.ones(rows, dtype=torch.float32, device=device)
        self.noise: Tensor | None = None  # [L, R, H_q, C] in cache order, made at the first step
        self.counts: list[list[int] | None] = [None] * rows  # host: entries each layer attends at the next step
        self.chosen = torch.zeros(n_layers, rows, dtype=torch.bool, device=device)  # code_frozen's key set chosen

    def join(self, row: int, state: EvictionState, layers: list) -> None:
        super().join(row, state, layers)
        self.counts[row] = [layer.keys.shape[-2] for layer in layers]
        for i in range(self.n_layers):
            self.chosen[i, row] = bool(state.extra.get(i, {}).get("key_set_chosen", False))

    def leave(self, row: int, state: EvictionState) -> None:
        for i in range(self.n_layers):
            state.extra.setdefault(i, {})["key_set_chosen"] = bool(self.chosen[i, row])
        self.counts[row] = None
        super().leave(row, state)

    def before_step(self, rows: list[int], layers: list[StaticRows]) -> None:
        super().before_step(rows, layers)
        method, capacity = self.method, layers[0].capacity
        if self.noise is None or self.noise.shape[-1] != capacity:
            self.noise = torch.zeros(self.n_layers, len(self.states), self.query_heads, capacity, device=self.device)
        for r in rows:
            state, counts = self.states[r], self.counts[r]
            self.tau[r] = method.tau(state)
            for i, n in enumerate(counts):
                n += 1  # the step's own token
                shape = (1, self.noise.shape[2], 1, n)
                draw = method.noise(torch.empty(shape, device=self.device), state)  # the eager draw, same shape
                self.noise[i, r, :, :n] = torch.as_tensor(draw, dtype=torch.float32,
                                                          device=self.device).expand(shape)[0, :, 0]
                counts[i] = min(n, state.budget)

    def row_score(self, layer_idx: int, logits: Tensor, order: Tensor) -> Tensor:
        groups = logits.shape[1] // order.shape[1]
        order_q = order.repeat_interleave(groups, dim=1) if groups > 1 else order
        noise = torch.zeros_like(logits).scatter_(-1, order_q, self.noise[layer_idx])
        return ((logits + noise) / self.tau.view(-1, 1, 1)).softmax(dim=-1)

    def keep(self, layer_idx: int, scores: Tensor, count: Tensor) -> tuple[Tensor, Tensor]:
        k = self.budget
        w = int(k * self.method.recent_ratio)
        over = (count > k)[..., None]
        paper = keep_mask(heavy_recent_keep(scores, k, w), scores)
        if self.method.selection == "paper":
            return paper, over
        n = scores.shape[-1]  # code_frozen, once chosen: drop the entry that just left the window (n = k + 1)
        frozen = torch.arange(n, device=scores.device) != n - w - 1
        chosen = self.chosen[layer_idx].view(-1, 1, 1)
        self.chosen[layer_idx] |= over[:, 0, 0]
        return torch.where(chosen, frozen.expand_as(paper), paper), over


class BuzzRule(BudgetRule):
    """BUZZ: H2O-style accumulated attention; once the middle exceeds T, the old samples are thinned by interval,
    the new buffer keeps each stride-chunk's first maximum, sinks and the window stay (`buzz_keep`), all by cache
    index arithmetic on the device, the old-sample count per row and layer included. `logn`: the attention scale
    times log_512 of the keys each row attends."""

    def __init__(self, method, budget: int, rows: int, n_layers: int, query_heads: int, device: torch.device):
        super().__init__(method, budget, rows, n_layers, query_heads, device)
        self.window, self.threshold = method.sizes(budget)
        self.m_old = torch.zeros(n_layers, rows, dtype=torch.long, device=device)

    def capacity(self, state: EvictionState, entries: int) -> int:
        return max(self.method.n_sink + self.window + self.threshold, entries) + 1

    def join(self, row: int, state: EvictionState, layers: list) -> None:
        super().join(row, state, layers)
        for i in range(self.n_layers):
            self.m_old[i, row] = int(state.extra.get(i, {}).get("m_old", 0))

    def leave(self, row: int, state: EvictionState) -> None:
        for i in range(self.n_layers):
            state.extra.setdefault(i, {})["m_old"] = int(self.m_old[i, row])
        super().leave(row, state)

    def scale(self, layer_idx: int, rows: StaticRows, scaling: float) -> Tensor:
        if not self.method.logn:
            return super().scale(layer_idx, rows, scaling)
        keys = rows.valid[:, 0].sum(dim=-1).double()  # (every head holds as many)
        return (scaling * torch.log(keys) / math.log(512)).float()

    def keep(self, layer_idx: int, scores: Tensor, count: Tensor) -> tuple[Tensor, Tensor]:
        sink, stride, window = self.method.n_sink, self.method.stride, self.window
        s_hat = (stride + 1) // 2
        r, h, c = scores.shape
        n = count[:, :1, None]  # [R, 1, 1]
        m_old = self.m_old[layer_idx].view(r, 1, 1)
        j = torch.arange(c, device=scores.device).view(1, 1, c)
        lo, hi = sink + m_old, n - window
        old = (j >= sink) & (j < lo) & ((j - sink) % s_hat == 0)
        middle = (j >= lo) & (j < hi)
        chunk = torch.where(middle, (j - lo) // stride, c).expand(r, h, c)  # c: outside the buffer
        masked = scores.masked_fill(~middle, float("-inf"))
        best = torch.full((r, h, c + 1), float("-inf"), device=scores.device).scatter_reduce(
            -1, chunk, masked, "amax", include_self=True)
        at_best = middle & (masked == best.gather(-1, chunk))
        first = torch.full((r, h, c + 1), c, dtype=torch.long, device=scores.device).scatter_reduce(
            -1, chunk, torch.where(at_best, j.expand(r, h, c), c), "amin", include_self=True)
        new = at_best & (first.gather(-1, chunk) == j)
        kept = (j < sink) | old | new | ((j >= hi) & (j < n))
        over = (n - sink - window > self.threshold)
        chunks = torch.div(hi - lo + stride - 1, stride, rounding_mode="floor")
        fresh = torch.div(m_old + s_hat - 1, s_hat, rounding_mode="floor") + chunks
        self.m_old[layer_idx] = torch.where(over, fresh, m_old).view(r)
        return kept, over
