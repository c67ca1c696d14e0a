"""Non-causal chunked attention scores (Chari & Van Durme, arXiv 2507.08143, "Compactor"). Reference: NVIDIA/kvpress
0.5.5 `NonCausalAttnPress`. The authors' code (vnchari/compactor-vllm @ 48d9f65, `compression/compactor.py`) has no
such method on its own: its non-causal attention is one half of Compactor's score (blended with leverage scores,
first and last tokens protected), unscaled as here, but without the value norm and the pooling, over chunks of 128,
with the last, shorter chunk's missing keys masked for real; that composition belongs to a `compactor` method.

The prompt is cut into chunks of `chunk_size`; inside each chunk every query attends every key of the chunk, both
ways (no causal mask, nothing across chunks). An entry's score is the attention its key receives summed over the
chunk's queries and averaged over the query heads of its KV group, times its value's L2 norm, smoothed by an
average pool of 3 (padding counted). The top `budget` per KV head are kept; question-agnostic.

As kvpress: the logits are raw q·k (no 1/√D: the softmax is sharper than the model's) on the post-RoPE queries and
keys, in fp32 after the product. Where the prompt is not a multiple of `chunk_size`, kvpress zero-pads the last chunk
and "masks" the padded keys with a logit of -1e-9 (so they still draw weight, as if their logit were 0) and the padded
queries with zero logits (their uniform rows add pad / chunk_size to each real key of that chunk): reproduced by
default; `mask_padding=true` masks them for real (padded keys get no weight, padded queries add nothing). kvpress's
final z-score (one mean and std per layer) does not change a per-head top-k and is left out.

Needs every prompt query: `query_window` asks the capture for all of them (`[B, H_q, n, D]` per layer, n_rep x a
layer's keys, held until the layer is compressed); the attention is built chunk by chunk (chunk_size² per head,
never n x n). Prefill only: under `decode_compression` the view holds fewer queries than entries, and it stops in one
line.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from kvbench.methods.base import LayerView, Method, reduce_groups
from kvbench.registry import METHODS

EVERY_QUERY = 1 << 40  # a query window longer than any prompt: the capture keeps all of its queries


def chunked_column_sums(queries: Tensor, keys: Tensor, chunk: int, mask_padding: bool) -> Tensor:
    """Queries `[B, H_q, n, D]`, keys `[B, H_kv, n, D]` -> `[B, H_q, n]`: each key's attention summed over the queries
    of its chunk (softmax over the chunk's keys, no causal mask)."""
    b, h_q, n, d = queries.shape
    h_kv = keys.shape[1]
    pad = math.ceil(n / chunk) * chunk - n
    q = F.pad(queries, (0, 0, 0, pad)).view(b, h_kv, h_q // h_kv, -1, chunk, d)  # [B, H_kv, r, C, c, D]
    k = F.pad(keys, (0, 0, 0, pad)).view(b, h_kv, 1, -1, chunk, d)
    logits = (q @ k.transpose(-1, -2)).float()  # [B, H_kv, r, C, c, c]: one chunk at a time per head
    if pad:
        padded = torch.arange(chunk, device=keys.device) >= chunk - pad  # inside the last chunk
        last = logits[..., -1, :, :]
        if mask_padding:
            last.masked_fill_(padded[None, :], float("-inf"))
        else:  # kvpress: padded query rows 0, padded key columns -1e-9
            last.masked_fill_(padded[:, None], 0.0)
            last.masked_fill_(padded[None, :], -1e-9)
    attn = logits.softmax(dim=-1)
    if pad and mask_padding:
        attn[..., -1, :, :].masked_fill_((torch.arange(chunk, device=keys.device) >= chunk - pad)[:, None], 0.0)
    return attn.sum(dim=-2).reshape(b, h_q, -1)[..., :n]


@METHODS.register("non_causal_attn")
@dataclass
class NonCausalAttn(Method):
    prefill_needs: ClassVar[str | None] = "every prompt query"  # (its non-causal attention)
    chunk_size: int = 256  # queries and keys per chunk of the non-causal attention (kvpress default)
    mask_padding: bool = False  # mask the last chunk's padding for real (kvpress: -1e-9 / 0 logits)

    def __post_init__(self):
        if self.chunk_size < 1:
            raise ValueError(f"non_causal_attn: chunk_size={self.chunk_size} must be >= 1")

    @property
    def query_window(self) -> int:
        return EVERY_QUERY

    def scores(self, view: LayerView) -> Tensor:
        """`[B, H_kv, n]`: chunk column sums averaged over each group, x value norm, average-pooled by 3."""
        queries, n = view.window_queries, view.prompt_len
        if queries is None or queries.shape[2] < n:
            got = 0 if queries is None else queries.shape[2]
            raise ValueError(f"non_causal_attn: scoring needs every prompt query ({n}), the view has {got}; it runs "
                             "at prefill only (not under decode_compression)")
        sums = chunked_column_sums(queries[:, :, -n:], view.keys, self.chunk_size, self.mask_padding)
        scores = reduce_groups(sums, view.keys.shape[1], "mean") * view.values.float().norm(dim=-1)
        return F.avg_pool1d(scores, kernel_size=3, stride=1, padding=1)

    def select(self, view: LayerView, n_keep: int) -> Tensor:
        return self.scores(view).topk(n_keep, dim=-1).indices.sort(dim=-1).values
