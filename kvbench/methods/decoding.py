"""Shared machinery for methods that keep evicting while the model generates (H2O, Keyformer, BUZZ).

A decoding method is a config dataclass; `start(...)` makes the per-sample `EvictionState` that holds, per layer,
accumulated scores `[B, H_kv, T]` aligned entry for entry with the cache. At prefill it receives the column sums
of the method's row score over the causal prompt attention (computed in chunks by the capture); after each decode
step it receives the new query's logits over the cache (new token included), accumulates, and evicts for real
with `layer.keep(idx)`, gathering its scores with the same indices. Nothing is kept across samples.

A chunk of several tokens fed on top of the cache (query=agnostic's question, a conversation's turn) is scored as
a prefill is: its causal rows' column sums add to the scores (`chunk`), then the layer is evicted to the budget.

Convention (every method): after each eviction a layer stores at most `budget` entries per head; the step that
triggers an eviction has already attended to all entries, including its own token (as H2O's real-drop cache).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
from torch import Tensor

from kvbench.attention.columns import causal_column_sums, grouped_logits
from kvbench.attention.sinks import sink_scorer
from kvbench.cache.evicting_rows import EvictingRows
from kvbench.cache.kv_cache import KVLayer
from kvbench.methods.base import Kind, Method, reduce_groups


@dataclass
class EvictionState:
    """Per-sample state of a decoding method: accumulated scores per layer, a step counter and a noise source."""

    method: "DecodingMethod"
    budget: int
    prompt_len: int
    max_new_tokens: int
    generator: torch.Generator
    scores: dict[int, Tensor] = field(default_factory=dict)
    extra: dict[int, dict] = field(default_factory=dict)  # per-layer method state (e.g. BUZZ's old-sample count)
    step: int = 0  # decode forwards so far (counted at layer 0)
    device_generators: dict = field(default_factory=dict)  # the same seed on other devices, made on first use
    layers: dict[int, KVLayer] = field(default_factory=dict, repr=False)  # each scored layer, as last handed over
    # (refreshed by every `prefill`/`decode` call, so a copied state never reaches another cache's layers)

    def generator_on(self, device: torch.device) -> torch.Generator:
        """The sample's noise source on `device`, so noise is drawn where the scores live (no host copy). The CPU
        stream is `generator` itself; a CUDA stream is seeded alike but draws different numbers."""
        if device.type == "cpu":
            return self.generator
        if device not in self.device_generators:
            self.device_generators[device] = torch.Generator(device).manual_seed(self.generator.initial_seed())
        return self.device_generators[device]

    def prefill(self, layer_idx: int, layer: KVLayer, column_sums: Tensor | None) -> None:
        if column_sums is None:  # a position-only policy (local window, rolling StreamingLLM): no scores needed
            column_sums = layer.keys.new_zeros(layer.keys.shape[:3], dtype=torch.float32)
        scores = self.method.prefill_scores(column_sums, layer.keys.shape[1])
        self.scores[layer_idx] = scores
        self.layers[layer_idx] = layer
        self.extra[layer_idx] = {}
        self._apply(layer_idx, layer, self.method.evict(self, layer_idx, scores, prefill=True))

    def decode(self, layer_idx: int, layer: KVLayer, query: Tensor, key: Tensor, scaling: float,
               bias: Tensor | None = None, softcap: float | None = None, logits: Tensor | None = None,
               sinks: Tensor | None = None) -> None:
        """Score the new query over the cache as the model does: soft cap (Gemma 2), then `bias` `[B, H_q, 1, k]`
        (the model's position bias, e.g. ALiBi). `logits` `[B, H_q, 1, k]`: those, already computed by the step's
        attention (batched decoding's one call), so they are not computed again. `sinks` `[H_q]`: learned sink
        logits (gpt-oss), one more column of the row that its score drops again. An MLA layer holds one latent head
        for all query heads: its row is reduced to the layer's heads, not the call's expanded ones."""
        if layer_idx == 0:
            self.step += 1
        self.layers[layer_idx] = layer
        h_kv = stored_heads(layer, key)
        if logits is None:
            logits = grouped_logits(query, key, scaling, softcap)
            if bias is not None:
                logits = logits + bias
        score = sink_scorer(lambda x: self.method.row_score(x, self, decoding=True), sinks)
        row = reduce_groups(score(logits)[:, :, 0], h_kv, self.method.gqa_reduce)
        if self.method.keeps_history:
            old = self.scores[layer_idx]
            scores = self.method.accumulate(
                torch.cat([old, old.new_zeros(*old.shape[:2], key.shape[2] - old.shape[2])], dim=-1), row)
        else:  # the step's own row replaces the scores (TOVA)
            scores = row
        self.scores[layer_idx] = scores
        self._apply(layer_idx, layer, self.method.evict(self, layer_idx, scores, prefill=False))

    def chunk(self, layer_idx: int, layer: KVLayer, query: Tensor, key: Tensor, scaling: float,
              softcap: float | None = None, sinks: Tensor | None = None) -> None:
        """A chunk of q tokens fed on top of the cache (`generation.feed`: an agnostic question, a turn), after
        this layer's attention: `query` `[B, H_q, q, D]`, `key` `[B, H_kv, L, D]` the layer's entries as attention saw
        them, the chunk's last. The chunk's rows are scored as prefill rows are (each sees every earlier entry and
        the chunk causally; `row_score(..., decoding=False)`, column sums over the rows by the prefill's helper
        `attention.columns.causal_column_sums`, rows at positions L - q..L - 1, 512 at a time),
        added to the entries' scores (the chunk's own entries start from zero) or replacing them (TOVA), and the
        layer is evicted to the budget as after a prefill (`evict(..., prefill=True)`: BUZZ thins its middle until
        it fits, Keyformer's code rule re-chooses its key set, a shared score waits for `prefill_done`)."""
        self.layers[layer_idx] = layer
        b, q = query.shape[0], query.shape[2]
        h_kv, length = stored_heads(layer, key), key.shape[2]
        if self.method.accumulates_attention:
            score = lambda logits: self.method.row_score(logits, self, decoding=False)  # noqa: E731
            sums = causal_column_sums(query, key, scaling, {"chunk": score}, offset=length - q, softcap=softcap,
                                      sinks=sinks)
            row = self.method.prefill_scores(sums["chunk"], h_kv)  # [B, H_q, L] -> the method's score layout
        else:  # a position-only policy: no scores needed
            row = key.new_zeros(b, h_kv, length, dtype=torch.float32)
        old = self.scores[layer_idx]
        if self.method.keeps_history and self.method.accumulates_attention:
            padded = torch.cat([old, old.new_zeros(*old.shape[:2], length - old.shape[-1])], dim=-1)
            row = self.method.accumulate(padded, row)
        self.scores[layer_idx] = row
        self._apply(layer_idx, layer, self.method.evict(self, layer_idx, row, prefill=True))

    @staticmethod
    def decode_many(states: list[EvictionState], layer_idx: int, layers: list[KVLayer], keys: list[Tensor],
                    logits: list[Tensor]) -> None:
        """`decode` for several samples with the step's logits given (`[1, H_q, 1, k]` each; batched decoding):
        samples of one method that scores `together`, with one budget and one cache length, are scored and
        chosen in one call, each then evicting from its own layer; the others one by one."""
        groups: dict[tuple, list[int]] = {}
        for s, (state, key) in enumerate(zip(states, keys)):
            alone = not state.method.together
            groups.setdefault((s if alone else -1, id(state.method), state.budget, *key.shape), []).append(s)
        for members in groups.values():
            if len(members) == 1:
                s = members[0]
                states[s].decode(layer_idx, layers[s], None, keys[s], 1.0, logits=logits[s])
                continue
            first = states[members[0]]
            for s in members:
                if layer_idx == 0:
                    states[s].step += 1
                states[s].layers[layer_idx] = layers[s]
            method, h_kv = first.method, keys[members[0]].shape[1]
            stacked = torch.cat([logits[s] for s in members])  # [S, H_q, 1, k]
            row = reduce_groups(method.row_score(stacked, first, decoding=True)[:, :, 0], h_kv, method.gqa_reduce)
            if method.keeps_history:
                old = torch.cat([states[s].scores[layer_idx] for s in members])
                row = method.accumulate(
                    torch.cat([old, old.new_zeros(*old.shape[:2], row.shape[-1] - old.shape[-1])], dim=-1), row)
            idx = method.evict(first, layer_idx, row, prefill=False)
            for k, s in enumerate(members):
                states[s].scores[layer_idx] = row[k:k + 1]
                states[s]._apply(layer_idx, layers[s], None if idx is None else idx[k:k + 1])

    @staticmethod
    def decode_rows(rows: EvictingRows, layer_idx: int, logits: Tensor) -> None:
        """`decode_many` for samples whose layer sits in one `EvictingRows` (one method that scores `together`, one
        budget): the step's logits `[R, H_q, budget + 1]` over every row as it lies are scored, chosen and kept in
        one call each (a free row's are scored too and ignored)."""
        states = [state for state in rows.states if state is not None]
        first = states[0]
        if layer_idx == 0:
            for state in states:
                state.step += 1
        method = first.method
        row = reduce_groups(method.row_score(logits[:, :, None], first, decoding=True)[:, :, 0],
                            rows.keys.shape[1], method.gqa_reduce)
        if method.keeps_history:  # (the new entry's slot holds 0: `EvictingRows.append_all`)
            rows.scores.copy_(method.accumulate(rows.scores, row))
        else:
            rows.scores.copy_(row)
        rows.keep_all(method.evict(first, layer_idx, rows.scores, prefill=False))

    def prefill_done(self) -> None:
        """Called once every layer's prefill eviction ran: a method that decides across layers (Keyformer's shared
        score) evicts here."""
        self.method.after_prefill(self)

    def apply(self, layer_idx: int, idx: Tensor) -> None:
        """Keep entries `idx` of scored layer `layer_idx` (another layer than the one being scored)."""
        self._apply(layer_idx, self.layers[layer_idx], idx)

    def _apply(self, layer_idx: int, layer: KVLayer, idx: Tensor | None) -> None:
        if idx is None:
            return
        layer.keep(idx)
        self.scores[layer_idx] = self.scores[layer_idx].gather(-1, idx)


@dataclass
class DecodingMethod(Method):
    """Base for accumulated-attention policies. Subclasses define `evict` (and `row_score` if not softmax)."""

    gqa_reduce: Literal["mean", "sum", "max"] = "mean"  # query heads of a KV group -> one score (MHA: no-op)

    kind: ClassVar[Kind] = Kind.EVICTOR
    accumulates_attention: ClassVar[bool] = True  # scores start from the capture's prefill column sums
    keeps_history: ClassVar[bool] = True  # each step's row adds to the scores; False: it replaces them (TOVA)
    together: ClassVar[bool] = False  # True: `row_score` and `evict` work row by row and read of the state only its
    #                                   budget, so batched decoding scores samples of one budget in one call (H2O)
    static_rule: ClassVar[bool] = False  # True: `row_score` and `evict` read of the state only its budget and are
    #                                      tensor code of fixed shapes: the static step runs them as they are

    @property
    def evicts_while_decoding(self) -> bool:
        return True

    def row_score(self, logits: Tensor, state: EvictionState | None, decoding: bool) -> Tensor:
        """Masked fp32 logits `[B, H_q, rows, n]` -> the per-row score that accumulates (softmax: H2O, BUZZ)."""
        return logits.softmax(dim=-1)

    def accumulate(self, old: Tensor, row: Tensor) -> Tensor:
        """The scores after a step (or a fed chunk) whose row score is `row`, from `old` (zero-padded to its width):
        their sum (H2O); Scissorhands decays `old` first."""
        return old + row

    def causal_block(self, budget: int) -> int | None:
        """None: the prefill scores use the causal mask. w: only the trailing w x w block is masked, as
        KVCache-Factory's H2O scored (earlier prompt rows then also attend to later keys)."""
        return None

    def prefill_scores(self, column_sums: Tensor, n_kv_heads: int) -> Tensor:
        """Column sums `[B, H_q, n]` -> the scores selection starts from: `[B, H_kv, n]` (query heads of a group
        combined by `gqa_reduce`), or `[B, H_q, n]` for a method that selects per query head."""
        return reduce_groups(column_sums, n_kv_heads, self.gqa_reduce)

    def start(self, prompt_len: int, budget: int, max_new_tokens: int, seed: int) -> EvictionState:
        return EvictionState(self, budget, prompt_len, max_new_tokens, torch.Generator().manual_seed(seed))

    def evict(self, state: EvictionState, layer_idx: int, scores: Tensor, prefill: bool) -> Tensor | None:
        """Indices `[B, H_kv, k]` (sorted) to keep, or None to keep everything."""
        raise NotImplementedError  # pragma: no cover - interface

    def after_prefill(self, state: EvictionState) -> None:
        """After every layer's prefill eviction (`EvictionState.prefill_done`); per-layer methods do nothing."""

    def layer_budgets(self, prompt_len: int, n_layers: int, budget: int) -> list[int]:
        return [prompt_len] * n_layers  # selection happens in the state, not through `select`


def stored_heads(layer, key: Tensor) -> int:
    """The heads a layer stores, which its scores are kept per: the attention call's key heads, except for an MLA
    layer, whose one latent head the model expands per query head before the call."""
    keys = getattr(layer, "keys", None)
    return keys.shape[1] if keys is not None and keys.shape[1] == 1 else key.shape[1]


def heavy_recent_keep(scores: Tensor, n_keep: int, recent: int) -> Tensor | None:
    """H2O's rule: the last `recent` entries plus the top-(n_keep - recent) of the others by score; None if the
    layer already fits. The entry that just left the recent window competes with the heavy hitters."""
    n = scores.shape[-1]
    if n <= n_keep:
        return None
    b, h, _ = scores.shape
    heavy = scores[..., : n - recent].topk(n_keep - recent, dim=-1).indices
    tail = torch.arange(n - recent, n, device=scores.device).expand(b, h, recent)
    return torch.cat([heavy, tail], dim=-1).sort(dim=-1).values
