"""Benchmark (not a test): what one `scaled_dot_product_attention` call costs for a shape it has seen and for a new
shape every call (a decode step's KV length grows by one each step, and layers of different lengths differ), with
PyTorch's own backend choice and with cuDNN's excluded (`kvbench.attention.decode.without_cudnn_attention`, what
kvbench's decode steps run under). On the first GPU check (H100, torch 2.11) PyTorch's choice cost 68.2 ms per new
shape against 0.09 ms per seen one (cuDNN builds a graph per shape); this script re-checks that on another card or
torch. Decode-shaped calls: one query token's G query heads over one KV head's L entries, bf16 on CUDA.

    python scripts/bench_sdpa_shapes.py [--batch 8] [--kv-heads 8] [--group 4] [--length 4000] [--calls 30]
"""
from __future__ import annotations

import argparse
import contextlib
import time

import torch
import torch.nn.functional as F

from kvbench.attention.decode import without_cudnn_attention


def per_call_ms(attend, lengths, device) -> float:
    """Mean ms of `attend(length)` over `lengths`, synchronized (CUDA) around the whole loop."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for length in lengths:
        attend(length)
    sync()
    return 1000 * (time.perf_counter() - t0) / len(lengths)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--group", type=int, default=4, help="query heads per KV head")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--length", type=int, default=4000, help="KV entries of the seen shape (new ones follow it)")
    ap.add_argument("--calls", type=int, default=30)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = (args.batch, args.kv_heads)
    query = torch.randn(*shape, args.group, args.head_dim, device=device, dtype=dtype)
    keys = torch.randn(*shape, args.length + 2 * args.calls + 1, args.head_dim, device=device, dtype=dtype)
    values = torch.randn_like(keys)

    def attend(length: int) -> None:
        F.scaled_dot_product_attention(query, keys[:, :, :length], values[:, :, :length])

    print(f"# torch {torch.__version__} on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, "
          f"{str(dtype).removeprefix('torch.')}, query {tuple(query.shape)}, {args.calls} calls each")
    print("| backends | seen shape ms/call | new shape ms/call |")
    print("|---|---|---|")
    for name, backends, offset in (("PyTorch's choice", contextlib.nullcontext, 0),
                                   ("without cuDNN", without_cudnn_attention, args.calls)):
        with backends():
            attend(args.length)  # warm the seen shape
            seen = per_call_ms(attend, [args.length] * args.calls, device)
            new = per_call_ms(attend, [args.length + 1 + offset + i for i in range(args.calls)], device)
        print(f"| {name} | {seen:.3f} | {new:.3f} |")


if __name__ == "__main__":
    main()
