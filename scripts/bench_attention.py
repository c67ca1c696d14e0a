"""Benchmark (not a test): one decode-attention step over S sequences whose lengths differ per sequence and per KV
head (Ada-KV-like), on this CPU, five ways: the engine's padded masked matmul (`kvbench.attention.decode`,
`padded=True`: every sequence copied into one block), padded masked `F.scaled_dot_product_attention`, nested
(jagged) tensors through sdpa, the engine's CPU default (`padded=False`: one masked matmul per sequence over its
own tensors, no copy), and a loop calling the engine once per sequence (what batched decoding did before). Each way builds its inputs from the same per-(sequence, head) K/V every
call, as a decode step must. Ways run interleaved, several rounds; each reports its median, as a ratio to the
per-sample loop. Shapes: SmolLM2-135M (9 query heads, 3 KV heads, head_dim 64) by default.

    python scripts/bench_attention.py [--batches 8 32] [--min-len 64] [--max-len 320] [--rounds 30]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from kvbench.attention.decode import decode_attention, pad
from kvbench.cache.kv_cache import DecodeKV


def ragged(s: int, h_kv: int, d: int, lo: int, hi: int, gen: torch.Generator):
    """Per sequence: keys/values `[1, H, L, D]` with per-head valid lengths (right-padded) as a layer hands them
    over, and the same as per-(sequence, head) tensors `[L_h, D]`."""
    kvs, heads = [], []
    for _ in range(s):
        lens = torch.randint(lo, hi + 1, (h_kv,), generator=gen)
        longest = int(lens.max())
        k, v = torch.randn(1, h_kv, longest, d, generator=gen), torch.randn(1, h_kv, longest, d, generator=gen)
        valid = torch.arange(longest)[None] < lens[:, None]
        kvs.append(DecodeKV(k, v, valid[None]))
        heads.append([(k[0, h, :n], v[0, h, :n]) for h, n in enumerate(lens.tolist())])
    return kvs, heads


def padded_sdpa(query, kvs, scale):
    keys, values, valid, _ = pad(kvs, positions=False)
    s, h_kv, _, d = keys.shape
    q = query.view(s, h_kv, -1, d)  # [S, H_kv, G, D]: GQA as grouped rows, one KV head each
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=valid[:, :, None], scale=scale)
    return out.reshape(s, 1, -1, d)


def nested_sdpa(query, heads, scale):
    s, h_q, _, d = query.shape
    h_kv = len(heads[0])
    g = h_q // h_kv
    q = torch.nested.nested_tensor(list(query.view(s * h_kv, g, 1, d).transpose(1, 2)), layout=torch.jagged)
    k = torch.nested.nested_tensor([k[:, None].expand(-1, g, -1) for seq in heads for k, _ in seq],
                                   layout=torch.jagged)
    v = torch.nested.nested_tensor([v[:, None].expand(-1, g, -1) for seq in heads for _, v in seq],
                                   layout=torch.jagged)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale)
    return torch.stack([t[:, 0] for t in out.unbind()]).view(s, 1, h_q, d)


def per_sample(query, kvs, scale):
    return torch.cat([decode_attention(query[i:i + 1], [kv], scale)[0] for i, kv in enumerate(kvs)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=320)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    scale = args.head_dim ** -0.5
    print(f"# threads=1 heads={args.heads}/{args.kv_heads} head_dim={args.head_dim} "
          f"lengths per (sequence, head) in [{args.min_len}, {args.max_len}]")
    print("| batch | engine padded matmul | padded sdpa | nested sdpa | engine per sequence (CPU default) | "
          "per-sample loop (1.00) |")
    print("|---|---|---|---|---|---|")
    for s in args.batches:
        gen = torch.Generator().manual_seed(s)
        kvs, heads = ragged(s, args.kv_heads, args.head_dim, args.min_len, args.max_len, gen)
        query = torch.randn(s, args.heads, 1, args.head_dim, generator=gen)
        ways = {"engine": lambda: decode_attention(query, kvs, scale, padded=True)[0],
                "engine_cpu": lambda: decode_attention(query, kvs, scale, padded=False)[0],
                "padded_sdpa": lambda: padded_sdpa(query, kvs, scale),
                "nested": lambda: nested_sdpa(query, heads, scale),
                "loop": lambda: per_sample(query, kvs, scale)}
        reference = ways["loop"]()
        for name, way in ways.items():  # all four compute the same attention
            torch.testing.assert_close(way(), reference, rtol=1e-4, atol=1e-5, msg=name)
        times = {name: [] for name in ways}
        for _ in range(args.rounds):
            for name, way in ways.items():  # interleaved: a burst of load hits every way alike
                t0 = time.perf_counter()
                way()
                times[name].append(time.perf_counter() - t0)
        median = {name: statistics.median(t) for name, t in times.items()}
        ratio = {name: median["loop"] / median[name] for name in ways}  # > 1: faster than the loop
        print(f"| {s} | {ratio['engine']:.2f}x | {ratio['padded_sdpa']:.2f}x | {ratio['nested']:.2f}x | "
              f"{ratio['engine_cpu']:.2f}x | 1.00x ({median['loop'] * 1e3:.2f} ms) |")


if __name__ == "__main__":
    main()
