"""Learned attention sinks (gpt-oss's `s_aux`): one extra logit per query head that joins each softmax row and
carries no value, so a row's probabilities over the real keys sum to less than one.

transformers' models that have them (gpt_oss, flint, granite_swa, granitemoe_swa, mimo_v2_flash, hy_v4, ...) pass
the per-head logits to the attention function as the `s_aux` keyword; their eager kernels concatenate it as a last
column, softmax, and drop that column. Every piece of kvbench that computes attention itself (the engine's decode
and chunk attention, window scoring, column sums, decode-time evictors' rows) does the same here, so a sink model
attends and scores exactly as its own kernel does.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def sink_softmax(logits: Tensor, sinks: Tensor | None) -> Tensor:
    """Softmax over the last dim of `logits` with each row's sink logit in the denominator (fp32). `sinks` must
    broadcast against `logits[..., :1]` (one per query head, viewed to the logits' head layout); None: plain
    softmax. A row whose keys are all masked (-inf) gives zeros, as the model's kernel does."""
    if sinks is None:
        return logits.softmax(dim=-1)
    sink = sinks.to(device=logits.device, dtype=torch.float32).expand_as(logits[..., :1])
    top = torch.maximum(logits.amax(dim=-1, keepdim=True), sink)  # the kernel subtracts the row's max, sink included
    weights = (logits.float() - top).exp()
    return weights / (weights.sum(dim=-1, keepdim=True) + (sink - top).exp())


def with_sink_column(logits: Tensor, sinks: Tensor | None) -> Tensor:
    """`logits` `[B, H_q, rows, k]` with each head's sink logit appended as column k (`sinks` `[H_q]`): a row scorer
    that softmaxes its input (H2O's, TOVA's) then scores with the sink in the denominator; drop the column after."""
    if sinks is None:
        return logits
    b, h, rows, _ = logits.shape
    column = sinks.to(device=logits.device, dtype=logits.dtype).view(1, h, 1, 1).expand(b, h, rows, 1)
    return torch.cat([logits, column], dim=-1)


def sink_scorer(score: Callable[[Tensor], Tensor], sinks: Tensor | None) -> Callable[[Tensor], Tensor]:
    """`score` (masked logits `[B, H_q, rows, k]` -> row scores of the same shape) applied with the sink column
    joined and dropped again; `score` itself when there is no sink."""
    if sinks is None:
        return score
    return lambda logits: score(with_sink_column(logits, sinks))[..., :-1]


def sinks_of(kwargs: dict) -> Tensor | None:
    """The sink logits `[H_q]` an attention call received (`s_aux`), detached; None for a model without them."""
    sinks = kwargs.get("s_aux")
    return None if sinks is None else sinks.detach()
