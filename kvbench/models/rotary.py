"""A layer's rotary position encoding as numbers (angles per frequency, scale, layout), read once from the (cos, sin)
the model hands its attention at prefill, so methods can rotate vectors to any position without the model.

Why: a scorer that predicts future queries (kvpress's Expected Attention) needs the rotation of positions the prompt
never reached and the pre-RoPE form of the queries the capture recorded post-RoPE. RoPE rotates each pair of dims
(i, i + R/2) ("half", HF rotate_half) or (2i, 2i + 1) ("interleaved", GPT-J) by `position * theta_i`, scaled by the
model's `attention_scaling` (1 for plain RoPE); dims past the R rotary dims (partial rotary) are untouched.
Learned (GPT-2) and ALiBi (MPT) positions leave queries unrotated: `Rotary.none()`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor


@dataclass(frozen=True)
class Rotary:
    theta: Tensor  # [R/2] fp32 angle per position of each rotated pair; empty: no rotation
    scale: float = 1.0  # attention_scaling folded into cos/sin by the model
    layout: Literal["half", "interleaved"] = "half"

    @classmethod
    def none(cls) -> "Rotary":
        return cls(torch.empty(0))

    @classmethod
    def from_embeddings(cls, cos: Tensor, sin: Tensor, layout: Literal["half", "interleaved"]) -> "Rotary":
        """From (cos, sin) of two or more consecutive positions `[B, q, R]` ("half": halves repeated) or `[B, q, R/2]`
        ("interleaved"). The angle is the rotation between the first two positions, so any start position works."""
        half = cos.shape[-1] // 2 if layout == "half" else cos.shape[-1]
        c, s = cos[0, :2, :half].double(), sin[0, :2, :half].double()
        theta = torch.atan2(s[1] * c[0] - c[1] * s[0], c[1] * c[0] + s[1] * s[0])
        return cls(theta.float().cpu(), float(torch.hypot(c[0, 0], s[0, 0])), layout)

    def pairs(self, head_dim: int) -> tuple[Tensor, Tensor]:
        """Indices (a, b) of the rotated pairs: b is rotated into a by -sin, a into b by +sin."""
        r = self.theta.shape[0]
        if self.layout == "half":
            return torch.arange(r), torch.arange(r) + r
        return torch.arange(0, 2 * r, 2), torch.arange(1, 2 * r, 2)

    def matrix(self, positions: Tensor, head_dim: int, mean: bool = False) -> Tensor:
        """The encoding matrices `[P, D, D]` (fp32) of `positions` `[P]`: x_encoded = M @ x. `mean=True`: their
        average `[D, D]` (entry-wise, as the matrices are linear in cos and sin)."""
        angle = positions.double()[:, None] * self.theta.double()[None]  # [P, R/2]
        cos, sin = self.scale * angle.cos(), self.scale * angle.sin()
        if mean:
            cos, sin = cos.mean(dim=0, keepdim=True), sin.mean(dim=0, keepdim=True)
        m = torch.eye(head_dim, dtype=torch.float64).repeat(cos.shape[0], 1, 1)
        if self.theta.numel():
            a, b = self.pairs(head_dim)
            m[:, a, a], m[:, b, b], m[:, a, b], m[:, b, a] = cos, cos, -sin, sin
        return (m[0] if mean else m).float()

    def unrotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """Pre-encoding vectors from encoded ones `[..., P, D]` at `positions` `[P]`, or one position per vector
        (`[..., P]`: a cache's entries after an eviction) (fp32): each pair rotated back by its angle and divided by
        the scale; dims past the rotary ones unchanged."""
        x = x.float()
        if self.theta.numel() == 0:
            return x
        a, b = (i.to(x.device) for i in self.pairs(x.shape[-1]))
        angle = positions.double()[..., None] * self.theta.double().to(positions.device)  # [..., P, R/2]
        cos, sin = (t.float().to(x.device) for t in (angle.cos(), angle.sin()))
        xa, xb = x[..., a], x[..., b]
        out = x.clone()
        out[..., a] = (xa * cos + xb * sin) / self.scale
        out[..., b] = (xb * cos - xa * sin) / self.scale
        return out
