"""Column sums of a row score over causal attention logits: what accumulated-attention evictors (H2O, Keyformer,
BUZZ, TOVA) add to their scores from several query rows at once.

One helper serves the prompt and every chunk fed later: the capture's prefill scoring (rows at positions 0..n-1 over
keys 0..n-1) and `EvictionState.chunk` (a question or a conversation's turn: q rows at positions p..p+q-1 over the
layer's p entries and the chunk's own, keys 0..p+q-1), so both build their logits, causal mask and sums alike. Rows
are taken `chunk` at a time (memory `chunk` x keys, never keys x keys); each block's logits are computed once for
every scorer.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable

import torch
from torch import Tensor

from kvbench.attention.sinks import sink_scorer


def grouped_logits(query: Tensor, key: Tensor, scaling: float, softcap: float | None = None) -> Tensor:
    """fp32 logits `[B, H_q, q, k]` of queries `[B, H_q, q, D]` over a layer's keys `[B, H_kv, k, D]` (each KV head
    shared by its group of query heads), soft-capped as the model caps them (Gemma 2)."""
    b, h_q, q, d = query.shape
    h_kv = key.shape[1]
    logits = query.float().reshape(b, h_kv, (h_q // h_kv) * q, d) @ key.float().transpose(-1, -2)
    logits = logits.mul_(scaling).view(b, h_q, q, -1)  # in place: q x k floats are this function's whole cost
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


@torch.no_grad()
def causal_column_sums(query: Tensor, key: Tensor, scaling: float, scorers: dict[Hashable, Callable[[Tensor], Tensor]],
                       offset: int = 0, softcap: float | None = None, score_bias: Callable | None = None,
                       block: int | None = None, chunk: int = 512,
                       sinks: Tensor | None = None) -> dict[Hashable, Tensor]:
    """Per scorer, the sum over the query rows of `scorer(masked logits [B, H_q, rows, k])`: `[B, H_q, k]`, fp32.

    `query` `[B, H_q, q, D]` holds the rows at positions `offset`..`offset + q - 1`, `key` `[B, H_kv, offset + q, D]`
    every key they may see (row r sees keys 0..r). The logits are shaped as the model shapes them: `softcap`
    (Gemma 2), then `score_bias(rows)` (ALiBi; `rows` a slice of the query rows) added, then future keys set to -inf.
    `block` w (KVCache-Factory's H2O): only the last w rows (positions >= offset + q - w) are masked causally.
    `sinks` `[H_q]` (gpt-oss's learned sinks): each scorer sees them as one more column, dropped from its scores."""
    b, h_q, q, _ = query.shape
    n_keys = key.shape[2]
    if n_keys != offset + q:
        raise ValueError(f"causal_column_sums: {q} rows at offset {offset} need {offset + q} keys, got {n_keys}")
    keys = key.float()  # once, not per block
    totals = {name: query.new_zeros(b, h_q, n_keys, dtype=torch.float32) for name in scorers}
    scorers = {name: sink_scorer(score, sinks) for name, score in scorers.items()}
    for start in range(0, q, chunk):
        rows = query[:, :, start:start + chunk]
        c = rows.shape[2]
        logits = grouped_logits(rows, keys, scaling, softcap)
        if score_bias is not None:
            logits += score_bias(slice(start, start + c))
        at = torch.arange(offset + start, offset + start + c, device=query.device)[:, None]
        future = torch.arange(n_keys, device=query.device)[None, :] > at
        if block is not None:  # earlier rows see every key, future ones included
            future = future & (at >= n_keys - block)
        masked = logits.masked_fill_(future, float("-inf"))  # in place, as above
        for name, score in scorers.items():
            totals[name] += score(masked).sum(dim=2)
    return totals
