"""Perplexity under a compressed cache: BUZZ's token-by-token stream and ordinary chunked windows.

Perplexity is teacher forcing, not generation: each position's logits are scored against the next true token, and
that token (not a sampled one) is fed next. The cache, the capture and the methods are the generation path's own:
`generation.prepare` (prefill, then compress), then one token per step of the engine (`batching.teacher_force`: a
forced-token sequence through the same step as generation), so decode-time methods (H2O, Keyformer,
BUZZ, any `DecodingMethod`) score and evict after every step through the same `EvictionState` / capture
`decode_hook` as in generation.

- `stream` (BUZZ `eval_long_ppl.py`): the rows of one record are fed one token at a time, the cache and the method's
  state are never reset between rows, and each row's tokens predict only their successor inside the row (its last
  token is not fed, its first is not predicted from the previous row). The first token of the stream is a 1-token
  prefill (its column sums are the row score of a single key, 1 for softmax and Gumbel-softmax alike). Methods that
  select only once after prefill (SnapKV, PyramidKV, Ada-KV, TailorKV) have nothing to select in a 1-token prefill:
  in a stream their cache grows like the full cache (`evicts_in_stream: false` in the record; use `chunked`).
- `chunked`: a window's first `context` tokens are prefilled and compressed by the method (any method), then the
  window's remaining tokens are teacher-forced one at a time; their NLL is the window's.
Positions follow the run's `positions`: original (the t-th fed token sits at t) or shift (at the cache's length,
the pos-shift of BUZZ's and StreamingLLM's code). PPL = exp(total NLL / total predicted tokens), over a run.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvbench.cache import KVCache
from kvbench.engine import batching as engine
from kvbench.engine.generation import Prepared, prepare
from kvbench.methods.base import Kind
from kvbench.registry import METHODS

logger = logging.getLogger(__name__)


@dataclass
class NLL:
    """Summed negative log-likelihood (nats) over `n_tokens` predicted tokens, plus the run's accounting."""

    nll_sum: float
    n_tokens: int
    kv_bytes: int          # held at the end
    full_kv_bytes: int     # a full cache of every fed token
    kept_per_layer: list[float]
    evicts: bool
    prefill_s: float
    step_s: float
    n_steps: int

    @property
    def ppl(self) -> float:
        return math.exp(self.nll_sum / self.n_tokens) if self.n_tokens else float("nan")


def _nll(logits: torch.Tensor, label: int) -> float:
    return F.cross_entropy(logits.float(), torch.tensor([label], device=logits.device)).item()


def teacher_force(model, capture, prep: Prepared, feeds: list[tuple[int, int | None]],
                  positions: str) -> tuple[float, int]:
    """Feed `(token, label)` pairs after the prepared cache, one per step of the engine (a forced-token sequence);
    returns (NLL sum, count). A pair's label, when given, is scored against the logits its own token produces."""
    labels = [label for _, label in feeds]
    total = [0.0, 0]

    def score(t: int, logits: torch.Tensor) -> None:
        if t and labels[t - 1] is not None:  # (t = 0: the prepared logits, scored by the caller)
            total[0] += _nll(logits, labels[t - 1])
            total[1] += 1

    engine.teacher_force(model, capture, prep, [token for token, _ in feeds], score, positions)
    return total[0], total[1]


@torch.no_grad()
def stream_nll(model, method, capture, rows: list[list[int]], budget, positions: str = "original",
               seed: int = 0) -> NLL:
    """BUZZ's streaming NLL over `rows` (token ids per row, special tokens included); see the module docstring."""
    feeds = [(row[i], row[i + 1]) for row in rows for i in range(len(row) - 1)]
    if not feeds:
        raise ValueError("wikitext_ppl: a stream with no token pair to score (all rows shorter than 2 tokens)")
    device = next(model.parameters()).device
    first, label = feeds[0]
    decoding = method.kind is Kind.EVICTOR  # others select once from a prompt: none here, keep all
    prep = prepare(model, method if decoding else METHODS["full"](), capture, torch.tensor([[first]], device=device),
                   budget, len(feeds), positions, seed)
    cache, state, logits = prep.cache, prep.state, prep.logits
    token_bytes = prep.full_kv_bytes  # one token, every layer, before any eviction
    total, count = _nll(logits, label), 1
    evicts = state is not None and method.evicts_while_decoding
    if state is not None:  # a 1-token prefill has no attention matrix: its column sums are one key's row score
        h_q = model.config.num_attention_heads
        one = method.row_score(torch.zeros(1, h_q, 1, 1, device=device), state, decoding=False).sum(dim=2)
        for i, scores in state.scores.items():
            state.scores[i] = method.prefill_scores(one, cache.layers[i].keys.shape[1]).to(scores)
    t0, t1 = 0.0, prep.timings["prefill_s"] + prep.timings["compress_s"]
    t_start = time.perf_counter()
    more, n = teacher_force(model, capture, prep, feeds[1:], positions)
    t2 = t1 + time.perf_counter() - t_start
    capture.reset()
    return NLL(total + more, count + n, cache.nbytes(), token_bytes * len(feeds),
               cache.entries_per_layer(), evicts, t1 - t0, t2 - t1, len(feeds) - 1)


@torch.no_grad()
def window_nll(model, method, capture, tokens: list[int], context: int, budget, positions: str = "original",
               seed: int = 0) -> NLL:
    """Chunked NLL of one window: prefill `tokens[:context]`, compress, teacher-force the rest."""
    if not 1 <= context < len(tokens):
        raise ValueError(f"wikitext_ppl: window of {len(tokens)} tokens with context={context}: need "
                         "1 <= context < window")
    device = next(model.parameters()).device
    feeds = [(tokens[i], tokens[i + 1] if i + 1 < len(tokens) else None) for i in range(context, len(tokens))]
    prep = prepare(model, method, capture, torch.tensor([tokens[:context]], device=device), budget, len(feeds),
                   positions, seed)
    cache, logits = prep.cache, prep.logits
    token_bytes = prep.full_kv_bytes // context
    t0, t1 = 0.0, prep.timings["prefill_s"] + prep.timings["compress_s"]
    total, count = _nll(logits, tokens[context]), 1
    t_start = time.perf_counter()
    more, n = teacher_force(model, capture, prep, feeds[:-1], positions)  # the last token is not fed
    t2 = t1 + time.perf_counter() - t_start
    capture.reset()
    return NLL(total + more, count + n, cache.nbytes(), token_bytes * (len(tokens) - 1),
               cache.entries_per_layer(), True, t1 - t0, t2 - t1, len(feeds) - 1)


def perplexity_record(model, method, capture, dataset, sample, budget, positions: str, seed: int) -> dict:
    """The predictions.jsonl record of one stream or window (kvbench.run calls this for perplexity datasets)."""
    from kvbench.data.base import sha256_text

    if dataset.mode == "stream":
        out = stream_nll(model, method, capture, dataset.rows_of(sample), budget, positions, seed)
    else:
        out = window_nll(model, method, capture, list(sample.input_ids), sample.meta["context"], budget, positions,
                         seed)
    kept = out.kept_per_layer
    return {
        "id": sample.id, "prompt_sha256": sha256_text(sample.prompt), "prompt_tokens": len(sample.input_ids),
        "prediction": "", "references": [], "score": out.ppl,
        "scores": {dataset.primary_metric: out.ppl, "nll_mean": out.nll_sum / out.n_tokens},
        "meta": sample.meta, "nll_sum": out.nll_sum, "n_tokens": out.n_tokens, "evicts_in_stream": out.evicts,
        "new_tokens": 0, "budget": budget, "kept_per_layer": kept, "effective_budget": sum(kept) / len(kept),
        "kv_bytes": out.kv_bytes, "full_kv_bytes": out.full_kv_bytes, "prefill_s": out.prefill_s,
        "decode_s": out.step_s, "decode_tok_s": out.n_steps / out.step_s if out.step_s > 0 else 0.0,
        "peak_mem_bytes": _peak_mem_bytes(),
    }


def _peak_mem_bytes() -> int:
    import resource

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB; process-lifetime peak


@torch.no_grad()
def continuation_logprob(model, method, capture, context: list[int], continuation: list[int], budget,
                         positions: str = "original", seed: int = 0) -> tuple[float, bool]:
    """lm-eval's loglikelihood under compression: prefill `context`, compress, teacher-force `continuation`.

    Returns (sum of log-probabilities of the continuation tokens, whether each was the argmax)."""
    device = next(model.parameters()).device
    prep = prepare(model, method, capture, torch.tensor([context], device=device), budget, max(len(continuation), 1),
                   positions, seed)
    total, greedy = 0.0, True

    def score(t: int, logits: torch.Tensor) -> None:
        nonlocal total, greedy
        logp = logits.float().log_softmax(dim=-1)[0]
        total += logp[continuation[t]].item()
        greedy = greedy and int(logp.argmax()) == continuation[t]

    if continuation:  # each token is scored by the logits before it; the last is not fed
        engine.teacher_force(model, capture, prep, continuation[:-1], score, positions)
    capture.reset()
    return total, greedy
