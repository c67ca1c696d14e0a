"""KeyDiff (Park et al., arXiv 2504.15364, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM
Inference in Resource-Constrained Environments"). Reference: NVIDIA/kvpress 0.5.5 `KeyDiffPress` and `BlockPress`
(kvpress's reading of the paper; the authors' own code is not public).

An entry's score is the negated cosine similarity of its key to the anchor, the mean of the layer's L2-normalised
keys (per KV head, on the cached post-RoPE keys): keys least like the average are kept. No queries, no attention, so
it is question-agnostic and runs with any attention kernel; nothing is protected.

- `block_size=128` (default): the paper's block-wise processing, as kvpress's `BlockPress(KeyDiffPress(),
  block_size=128)` simulates it: the first `budget` entries are kept, then for each following block of `block_size`
  prompt entries the anchor is recomputed over the kept entries + the block, and the `budget` best of them stay.
  As kvpress's, a simulation: every key was computed by the full prefill (a real block prefill would let later
  blocks attend only the kept entries).
- `block_size=0`: one shot over the whole prompt (kvpress's `KeyDiffPress` alone).
Scores in fp32. No compression when the prompt is not longer than the budget.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor

from kvbench.methods.base import LayerView, Method
from kvbench.methods.wrappers import blockwise
from kvbench.registry import METHODS


def keydiff_scores(keys: Tensor) -> Tensor:
    """`[B, H, T, D]` -> `[B, H, T]`: minus each key's cosine similarity to the mean normalised key."""
    keys = keys.float()
    anchor = F.normalize(keys, p=2, dim=-1).mean(dim=2, keepdim=True)
    return -F.cosine_similarity(keys, anchor, dim=-1)


@METHODS.register("keydiff")
@dataclass
class KeyDiff(Method):
    block_size: int = 128  # prompt entries per block of the block-wise pass (0: one shot, kvpress KeyDiffPress)

    def __post_init__(self):
        if not isinstance(self.block_size, int) or self.block_size < 0:
            raise ValueError(f"keydiff: block_size={self.block_size!r} must be an integer >= 0 (0: one shot)")

    def scores(self, view: LayerView) -> Tensor:
        """One-shot KeyDiff scores `[B, H_kv, n]` (what `block_size=0` ranks, and what kvpress's BlockPress and
        ChunkPress wrap)."""
        return keydiff_scores(view.keys)

    def select(self, view: LayerView, n_keep: int) -> Tensor:
        keys, n = view.keys, view.prompt_len
        if not self.block_size:
            return keydiff_scores(keys).topk(n_keep, dim=-1).indices.sort(dim=-1).values
        d = keys.shape[-1]

        def score(candidates: Tensor) -> Tensor:
            return keydiff_scores(keys.gather(2, candidates.unsqueeze(-1).expand(-1, -1, -1, d)))

        return blockwise(n, n_keep, self.block_size, score, keys)
