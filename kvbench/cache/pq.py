"""Product quantization of keys (PQCache, Zhang et al. 2024): a seeded K-means per (sequence, KV head, partition),
codes, and the approximate q·k they give.

A key `[D]` is cut into `M` contiguous sub-vectors of `D / M` dimensions (partition m = dims [m·D/M, (m+1)·D/M), the
reference's `reshape(..., M, D // M)`); each partition has its own `C = 2**bits` centroids and each key one code per
partition. q·k is approximated by Σ_m q_m · centroid_m[code_m]: one `[M, C]` table of inner products per query head,
then a gather per key.

K-means follows the reference's call (HugoZHL/PQCache@0b74e12, `multi_core_compressor_v2.py`: sklearn `KMeans`,
Lloyd, `n_init=1`, initial centroids = C distinct keys drawn by a seeded RNG, the same draw for every group of a
layer, `tol=1e-4`), in torch so it runs where the keys are, batched over groups:
- the initial keys come from `torch.randperm` with a `torch.Generator` seeded by `seed` (the reference seeds numpy:
  same rule, different draw);
- stop after `iters` Lloyd iterations, or earlier once every group's squared centroid shift is <= tol x the mean
  per-dimension variance of its keys (sklearn's relative tolerance);
- an empty cluster keeps its previous centroid (sklearn relocates it to a far point);
- the labels returned are those of the final centroids (sklearn re-runs the assignment step too).
Cost: `iters` x (G x n x C x D/M) multiply-adds; assignments are computed in chunks of tokens (bounded memory).
"""
from __future__ import annotations

import torch
from torch import Tensor

CHUNK = 32768  # tokens per assignment chunk: G x CHUNK x C distances at once


def assign(x: Tensor, centroids: Tensor) -> Tensor:
    """Nearest centroid (Euclidean) of each row: x `[G, n, d]`, centroids `[G, C, d]` -> labels `[G, n]` int64
    (ties: the lowest index)."""
    c2 = (centroids * centroids).sum(-1)[:, None]  # [G, 1, C]
    labels = [((c2 - 2 * chunk @ centroids.transpose(1, 2))).argmin(-1) for chunk in x.split(CHUNK, dim=1)]
    return torch.cat(labels, dim=1)


@torch.no_grad()
def kmeans(x: Tensor, n_clusters: int, iters: int, seed: int, tol: float = 1e-4) -> tuple[Tensor, Tensor]:
    """Seeded Lloyd K-means of each group: x `[G, n, d]` (n >= n_clusters) -> centroids `[G, C, d]` fp32 and
    labels `[G, n]`; see the module docstring."""
    x = x.float()
    g, n, d = x.shape
    if n < n_clusters:
        raise ValueError(f"pq: {n} keys cannot form {n_clusters} clusters")
    first = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:n_clusters].to(x.device)
    centroids = x[:, first].clone()
    threshold = tol * x.var(dim=1, unbiased=False).mean(dim=-1)  # [G]
    ones = x.new_ones(g, n)
    for _ in range(iters):
        labels = assign(x, centroids)
        sums = x.new_zeros(g, n_clusters, d).scatter_add_(1, labels[..., None].expand(g, n, d), x)
        counts = x.new_zeros(g, n_clusters).scatter_add_(1, labels, ones)[..., None]
        new = torch.where(counts > 0, sums / counts.clamp(min=1), centroids)
        shift = ((new - centroids) ** 2).sum(dim=(1, 2))
        centroids = new
        if bool((shift <= threshold).all()):
            break
    return centroids, assign(x, centroids)


def split(keys: Tensor, partitions: int) -> Tensor:
    """Keys `[B, H, n, D]` -> groups `[B * H * M, n, D / M]` (group = (b, h, m))."""
    b, h, n, d = keys.shape
    return keys.reshape(b, h, n, partitions, d // partitions).permute(0, 1, 3, 2, 4).reshape(-1, n, d // partitions)


def train(keys: Tensor, partitions: int, bits: int, iters: int, seed: int) -> tuple[Tensor, Tensor]:
    """Codebook of keys `[B, H, n, D]`: centroids `[B, H, M, C, D / M]` fp32 and codes `[B, H, M, n]` uint8."""
    b, h, n, d = keys.shape
    centroids, labels = kmeans(split(keys, partitions), 2 ** bits, iters, seed)
    return (centroids.reshape(b, h, partitions, 2 ** bits, d // partitions),
            labels.reshape(b, h, partitions, n).to(torch.uint8))


def encode(keys: Tensor, centroids: Tensor) -> Tensor:
    """Codes `[B, H, M, n]` uint8 of new keys `[B, H, n, D]` under an existing codebook (nearest centroid per
    partition, as the reference encodes tokens leaving the local window)."""
    b, h, m, c, sub = centroids.shape
    labels = assign(split(keys.float(), m), centroids.float().reshape(-1, c, sub))
    return labels.reshape(b, h, m, -1).to(torch.uint8)


def approximate_logits(query: Tensor, centroids: Tensor, codes: Tensor) -> Tensor:
    """Σ_m q_m · centroid_m[code_m] for each query head and key: query `[B, H_q, 1, D]`, centroids
    `[B, H, M, C, D / M]`, codes `[B, H, M, N]` -> `[B, H, G, N]` fp32 (G = H_q / H query heads per KV head)."""
    b, h, m, c, sub = centroids.shape
    q = query.float().reshape(b, h, -1, m, sub)  # [B, H, G, M, sub]
    table = torch.einsum("bhgms,bhmcs->bhgmc", q, centroids.float())  # [B, H, G, M, C]
    out = 0
    for part in range(m):  # one partition at a time: a [B, H, G, N] gather, no [.., M, N] index tensor
        index = codes[:, :, part].long()[:, :, None].expand(b, h, q.shape[2], codes.shape[-1])
        out = out + table[:, :, :, part].gather(-1, index)
    return out
