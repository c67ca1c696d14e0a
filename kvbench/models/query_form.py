"""How a layer forms its queries, found from the model's own queries at the first prefill (generic path).

Why: TailorKV's q-hat projects another layer's input through this layer's query path, and Expected Attention rotates
query statistics with the layer's rotary angles. Families differ in ways a config does not say: the norm acts per head
before RoPE (Qwen3), over the whole projection (OLMo 2/3, MiniMax-M2) or after RoPE (Hunyuan, Llama 4's L2 norm), the
rotary pairs are halves or adjacent dims (ERNIE, Cohere, GLM; Llama 4 as complex numbers), and some layers have no
rotary at all (SmolLM3, Llama 4, EXAONE 4 NoPE layers). Rather than list these per family, the capture holds the last
prompt row's input and position encoding, and the query the attention function then receives, and tries each
candidate form: the one that reproduces the model's query is the layer's form. None reproduces it (Llama 4's
temperature-scaled NoPE queries, a fused or gated projection): the layer has no form, and a method that needs one
refuses in one line.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor

from kvbench.models.rotary import Rotary

Rotation = Literal["none", "half", "interleaved", "pairwise"]


@dataclass(frozen=True)
class QueryForm:
    projection: str  # the module's query projection (an nn.Linear child with H_q x D outputs)
    norm: str | None  # its query norm child, or None
    norm_over: Literal["head", "projection"] = "head"  # per head [.., H, D], or over the whole projection [.., H x D]
    norm_after_rope: bool = False
    rotation: Rotation = "half"
    n_heads: int = 0  # query heads (set by `discover`)

    def query(self, module: torch.nn.Module, hidden: Tensor, position_embeddings, n_heads: int | None = None) -> Tensor:
        """`module`'s query for `hidden` `[B, q, hidden]` at the positions `position_embeddings` encodes:
        `[B, H_q, q, D]`."""
        n_heads = n_heads or self.n_heads
        query = getattr(module, self.projection)(hidden)
        head_dim = query.shape[-1] // n_heads
        if self.norm is not None and not self.norm_after_rope:
            query = self._norm(module, query, n_heads)
        query = query.view(*hidden.shape[:2], n_heads, head_dim).transpose(1, 2)
        query = rotate(query, position_embeddings, self.rotation)
        if self.norm is not None and self.norm_after_rope:
            query = getattr(module, self.norm)(query.transpose(1, 2)).transpose(1, 2)
        return query

    def _norm(self, module, query: Tensor, n_heads: int) -> Tensor:
        norm = getattr(module, self.norm)
        if self.norm_over == "projection":
            return norm(query)
        return norm(query.view(*query.shape[:-1], n_heads, -1)).flatten(-2)


def last_rows(position_embeddings, rows: int):
    """The position encoding of a prefill's last `rows` rows (a (cos, sin) pair or a complex table, `[B, q, ...]`)."""
    if isinstance(position_embeddings, Tensor):
        return position_embeddings[:, -rows:]
    if isinstance(position_embeddings, (tuple, list)):
        return tuple(t[:, -rows:] for t in position_embeddings)
    return position_embeddings


def to_device(position_embeddings, device):
    if isinstance(position_embeddings, Tensor):
        return position_embeddings.to(device)
    if isinstance(position_embeddings, (tuple, list)):
        return tuple(t.to(device) for t in position_embeddings)
    return position_embeddings


def cos_sin(position_embeddings) -> tuple[Tensor, Tensor] | None:
    """(cos, sin) `[B, q, width]` from what the model hands its attention: a (cos, sin) pair, or Llama 4's complex
    `freqs_cis` (real and imaginary parts of adjacent pairs)."""
    if position_embeddings is None:
        return None
    if isinstance(position_embeddings, Tensor) and position_embeddings.is_complex():
        return position_embeddings.real, position_embeddings.imag
    if isinstance(position_embeddings, (tuple, list)) and len(position_embeddings) == 2:
        return tuple(position_embeddings)
    return None


def pair_angles(position_embeddings, rotation: Rotation) -> tuple[Tensor, Tensor] | None:
    """Per rotated pair (cos, sin) `[B, q, R/2]` for `rotation`: "half" and "interleaved" tables are full width (each
    pair's value twice, as HF builds them); "pairwise" tables (GPT-J's, Llama 4's complex one) hold one per pair."""
    pair = cos_sin(position_embeddings)
    if pair is None or rotation == "none":
        return None
    cos, sin = pair
    if rotation == "half":
        return cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]
    if rotation == "interleaved":
        return cos[..., ::2], sin[..., ::2]
    return cos, sin


def rotate(query: Tensor, position_embeddings, rotation: Rotation) -> Tensor:
    """`query` `[B, H, q, D]` rotated as `rotation` says by the model's position encoding (dims past the rotary ones,
    partial rotary, are left as they are)."""
    angles = pair_angles(position_embeddings, rotation)
    if angles is None:
        return query
    cos, sin = (x.unsqueeze(1).to(query.dtype) for x in angles)
    r = cos.shape[-1]
    if rotation == "half":
        a, b = query[..., :r], query[..., r:2 * r]
        return torch.cat([a * cos - b * sin, b * cos + a * sin, query[..., 2 * r:]], dim=-1)
    a, b = query[..., 0:2 * r:2], query[..., 1:2 * r:2]
    pairs = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    return torch.cat([pairs, query[..., 2 * r:]], dim=-1)


def rotary_of(form: "QueryForm | None", position_embeddings) -> Rotary | None:
    """The layer's rotary angles (`kvbench.models.rotary`) from a prefill's position encoding (two or more positions)
    under its found form; `Rotary.none()` for a NoPE layer, None when the form is unknown."""
    if form is None:
        return None
    if form.rotation == "none":
        return Rotary.none()
    cos, sin = cos_sin(position_embeddings)
    if form.rotation == "interleaved":
        cos, sin = cos[..., ::2], sin[..., ::2]
    return Rotary.from_embeddings(cos, sin, "half" if form.rotation == "half" else "interleaved")


def candidates(module: torch.nn.Module, n_heads: int, head_dim: int) -> list[QueryForm]:
    """Every form worth trying for `module`: each linear child with H_q x D outputs, each norm-like child (or none) in
    each placement, each rotation."""
    projections = [name for name, child in module.named_children()
                   if isinstance(child, torch.nn.Linear) and child.out_features == n_heads * head_dim]
    norms = [name for name, child in module.named_children() if "norm" in type(child).__name__.lower()]
    forms = []
    for projection, rotation in itertools.product(projections, ("none", "half", "interleaved", "pairwise")):
        forms.append(QueryForm(projection, None, rotation=rotation))
        for norm, over, after in itertools.product(norms, ("head", "projection"), (False, True)):
            if not (after and over == "projection"):
                forms.append(QueryForm(projection, norm, over, after, rotation))
    return forms


@torch.no_grad()
def discover(module: torch.nn.Module, hidden: Tensor, position_embeddings, query: Tensor) -> QueryForm | None:
    """The first candidate form that reproduces `query` `[B, H_q, q, D]` (the rows the attention function received)
    from `hidden` `[B, q, hidden]` (the same rows' attention input), or None. A match is equality up to a few
    roundings of the query's dtype, far below what a wrong norm, rotation or projection changes."""
    n_heads, head_dim = query.shape[1], query.shape[-1]
    target = query.float()
    tolerance = 64 * torch.finfo(query.dtype).eps * float(target.abs().max()) + 1e-6
    for form in candidates(module, n_heads, head_dim):
        try:
            guess = form.query(module, hidden, position_embeddings, n_heads)
        except (RuntimeError, ValueError, TypeError):
            continue
        if guess.shape == query.shape and float((guess.float() - target).abs().max()) <= tolerance:
            return replace(form, n_heads=n_heads)
    return None


__all__ = ["QueryForm", "cos_sin", "discover", "last_rows", "pair_angles", "rotary_of", "rotate", "to_device"]
