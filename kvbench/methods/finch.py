"""FINCH (Corallo & Papotti, TACL 2024, "FINCH: Prompt-guided Key-Value Cache Compression for Large Language Models").
Reference: NVIDIA/kvpress 0.5.5 `FinchPress`, which the authors' repository (giulio98/context-compression) names as
the official implementation, bit-exact with their code.

SnapKV-style scoring whose observation window is the question: the prompt's question tokens score the context by
the attention they pay it (softmax over all keys in fp32, causal inside the window, the model's scale), each window
row i (at position n - w + i) multiplied by n - w + i when `normalize_scores` (kvpress's "number of non-zero
weights"), averaged over the rows and over the query heads of each KV group; no pooling. The question itself scores
the maximum + 1 and is kept. One top-k over the prompt, or with `chunk_length` a top-k inside each chunk of that many
entries, each chunk keeping its share of the budget.

The window: kvpress finds the question by a delimiter token inserted before it (removed again at the embedding);
kvbench's datasets know where their context ends (`Sample.context_end`), and under query=aware the runner hands the
question's token count to every layer (`view.question_len`; `window_is_question`). `window=w` > 0 uses the prompt's
last w tokens instead (any dataset, query=agnostic included). Under query=agnostic the default is refused: the
question comes after the compression. In conversations and grid sweeps the question is not handed over yet: set
`window` there.

Positions: kvpress re-rotates the kept keys to consecutive positions (`rerotate_keys=True`, FINCH's reading): that is
the run-level `positions=shift` (kvbench's default keeps original positions, kvpress's `rerotate_keys=False`).
Budgets: kvbench keeps exactly `budget`; in chunks, kvpress keeps int(c (1 - ratio)) per chunk, which may total
less, and kvbench gives the remainder to the chunks with the largest fractional shares (the same sets whenever the
shares are whole). Prefill only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kvbench.methods.base import LayerView, Method, reduce_groups, window_attention
from kvbench.registry import METHODS


def chunk_quotas(n: int, chunk: int, n_keep: int) -> list[int]:
    """Entries each chunk of `chunk` (the last one shorter) keeps: its share of `n_keep`, remainders to the largest."""
    sizes = [min(chunk, n - s) for s in range(0, n, chunk)]
    shares = [size * n_keep / n for size in sizes]
    quotas = [int(s) for s in shares]
    for i in sorted(range(len(sizes)), key=lambda i: quotas[i] - shares[i])[: n_keep - sum(quotas)]:
        quotas[i] += 1
    return quotas


@METHODS.register("finch")
@dataclass
class Finch(Method):
    window: int = 0  # 0: the question (kvpress's delimiter); w > 0: the prompt's last w tokens
    chunk_length: int = 0  # 0: one top-k over the prompt; c > 0: a top-k inside each chunk of c entries
    normalize_scores: bool = True  # multiply each window row by its position (kvpress default)

    def __post_init__(self):
        if self.window < 0:
            raise ValueError(f"finch: window={self.window} must be >= 0 (0: the question)")
        if self.chunk_length < 0:
            raise ValueError(f"finch: chunk_length={self.chunk_length} must be >= 0 (0: no chunks)")

    @property
    def window_is_question(self) -> bool:
        return self.window == 0

    @property
    def query_window(self) -> int:
        return self.window  # (the question: prepare records its length's worth)

    @property
    def kept_window(self) -> int:
        return self.window

    def check_budget(self, budget: int | None) -> None:
        super().check_budget(budget)
        self.check_below_budget("window", budget)

    def window_size(self, view: LayerView) -> int:
        w = self.window or view.question_len
        if not w:
            raise ValueError("finch: no question to score with (its window is the question; this dataset or run mode "
                             "does not split the prompt): set method.window=<last tokens>")
        if view.window_queries is None or view.window_queries.shape[2] < w or w >= view.prompt_len:
            got = 0 if view.window_queries is None else view.window_queries.shape[2]
            raise ValueError(f"finch: a {w}-token window needs {w} queries of a longer prompt; the view has {got} of "
                             f"{view.prompt_len}")
        return w

    def scores(self, view: LayerView) -> Tensor:
        """`[B, H_kv, n]` fp32: the window's (normalised) mean attention to each context entry; the window max + 1."""
        n, w = view.prompt_len, self.window_size(view)
        attn = window_attention(view.window_queries[:, :, -w:], view.keys, view.scaling, view.window_bias,
                                view.softcap, view.sinks)[..., : n - w]  # [B, H_q, w, n - w]
        if self.normalize_scores:
            attn = attn * torch.arange(n - w, n, device=attn.device, dtype=attn.dtype)[:, None]
        scores = reduce_groups(attn.mean(dim=2), view.keys.shape[1], "mean")
        return F.pad(scores, (0, w), value=float(scores.max()) + 1)

    def select(self, view: LayerView, n_keep: int) -> Tensor:
        scores, n = self.scores(view), view.prompt_len
        w = self.window or view.question_len
        if n_keep <= w:
            raise ValueError(f"finch: the {w}-token window fills the budget ({n_keep} entries); raise budget")
        if not self.chunk_length:
            return scores.topk(n_keep, dim=-1).indices.sort(dim=-1).values
        c, quotas = self.chunk_length, chunk_quotas(n, self.chunk_length, n_keep)
        starts = range(0, n, c)
        for start, k in zip(starts, quotas):  # kvpress asserts chunk_length > window / (1 - ratio) for this
            if k < min(start + c, n) - max(start, n - w):
                raise ValueError(f"finch: the chunk at {start} keeps {k} entries, fewer than the window has in it; "
                                 "raise method.chunk_length or budget")
        kept = [start + scores[..., start:start + c].topk(k, dim=-1).indices for start, k in zip(starts, quotas) if k]
        return torch.cat(kept, dim=-1).sort(dim=-1).values
