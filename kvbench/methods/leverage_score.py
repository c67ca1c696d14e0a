"""Approximate leverage scores of the keys (Chari & Van Durme, arXiv 2507.08143, "Compactor: Calibrated
Query-Agnostic KV Cache Compression with Approximate Leverage Scores"). Reference: NVIDIA/kvpress 0.5.5
`LeverageScorePress` (its docstring notes it solves with a Cholesky factor where the paper differs). The authors'
code (vnchari/compactor-vllm @ 48d9f65, `approximate_leverage_scores`) scores chunks of 512 keys each against their
own Gram matrix (regulariser 5e-3, an SVD) and uses the scores inside Compactor only; kvbench follows kvpress's
standalone press (one Gram matrix over the whole prompt).

Per layer and KV head, the pre-RoPE keys `K` `[n, D]` are centred over the sequence and sketched on the right by a
Gaussian `Φ` `[D, sketch_dimension]` / √sketch_dimension: X = (K - mean) Φ. An entry's score is its leverage in X,
x_i (XᵀX)⁻¹ x_iᵀ (clamped at 0), solved through a Cholesky factor of XᵀX + jitter I (jitter 1e-2, raised tenfold
until the factorisation succeeds, as kvpress). Outlying keys score high and are kept; the top `budget` per KV head.
Question-agnostic, no attention.

Deviations from kvpress: the sketch comes from a generator seeded with `seed + layer` (kvpress draws from the global
generator: not reproducible); pre-RoPE keys are the cached keys rotated back by the layer's rotary angles
(`view.rotary`, at each entry's original position) where kvpress recomputes them from the hidden states (equal up
to fp32 rounding); kvpress's final z-score (one mean and std over the layer) does not change a per-head top-k and is
left out. kvpress scores at prefill only (it asserts one query per key); kvbench also scores a layer compressed again
while decoding (`decode_compression`) or a wrapper's subset (chunk, block, compose): each key is rotated back from
its own original position (`view.positions`), not from its slot.
"""
from __future__ import annotations

from typing import ClassVar

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from kvbench.methods.base import LayerView, Method
from kvbench.registry import METHODS


def prerope_keys(view: LayerView) -> Tensor:
    """The layer's keys before the rotary encoding, `[B, H_kv, n, D]` fp32, each rotated back from its own position
    (`view.positions`; 0..n-1 after a prefill)."""
    if view.rotary is None:
        return view.keys.float()
    if view.positions is not None:
        return view.rotary.unrotate(view.keys, view.positions)
    return view.rotary.unrotate(view.keys, torch.arange(view.prompt_len, device=view.keys.device))


def cholesky_with_jitter(gram: Tensor, jitter: float = 1e-2, tries: int = 5) -> Tensor:
    """Lower Cholesky factor of `gram` + jitter I, the jitter raised tenfold until it factorises (kvpress's rule)."""
    eye = torch.eye(gram.shape[-1], device=gram.device, dtype=gram.dtype)
    for _ in range(tries):
        factor, info = torch.linalg.cholesky_ex(gram + jitter * eye)
        if bool((info == 0).all()):
            return factor
        jitter = 10.0 * jitter
    raise ValueError(f"leverage_score: the sketched Gram matrix did not factorise with jitter up to {jitter / 10:g}")


def leverage_scores(keys: Tensor, sketch: Tensor) -> Tensor:
    """`[B, H, n, D]` keys, `[B, H, D, k]` sketch -> `[B, H, n]` leverage of each centred, sketched key."""
    x = ((keys - keys.mean(dim=-2, keepdim=True)) @ sketch).float()  # [B, H, n, k]
    gram = x.transpose(-2, -1) @ x
    factor = cholesky_with_jitter(0.5 * (gram + gram.transpose(-2, -1)))
    solved = torch.cholesky_solve(x.transpose(-2, -1), factor)  # (XᵀX)⁻¹ Xᵀ: [B, H, k, n]
    return (x * solved.transpose(-2, -1)).sum(dim=-1).clamp_min(0)


@METHODS.register("leverage_score")
@dataclass
class LeverageScore(Method):
    reads_per_head: ClassVar[frozenset[str]] = frozenset({"rotary angles"})  # (MLA: refused)
    sketch_dimension: int = 48  # columns of the Gaussian sketch (kvpress default)
    seed: int = 0  # the sketch's seed (layer i draws from seed + i)

    def __post_init__(self):
        if self.sketch_dimension < 1:
            raise ValueError(f"leverage_score: sketch_dimension={self.sketch_dimension} must be >= 1")
        if self.seed < 0:
            raise ValueError(f"leverage_score: seed={self.seed} must be >= 0")

    def sketch(self, view: LayerView) -> Tensor:
        """`[B, H_kv, D, k]`: kvpress's draw `randn(B, H, D, k) / √k` from `seed + layer`, each batch row alike."""
        _, h, _, d = view.keys.shape
        gen = torch.Generator(device=view.keys.device).manual_seed(self.seed + view.layer_idx)
        one = torch.randn(1, h, d, self.sketch_dimension, generator=gen, device=view.keys.device,
                          dtype=view.keys.dtype) * (1 / math.sqrt(self.sketch_dimension))
        return one.expand(view.keys.shape[0], -1, -1, -1).float()

    def scores(self, view: LayerView) -> Tensor:
        return leverage_scores(prerope_keys(view), self.sketch(view))

    def select(self, view: LayerView, n_keep: int) -> Tensor:
        return self.scores(view).topk(n_keep, dim=-1).indices.sort(dim=-1).values
