"""Benchmark (not a test): TailorKV's decode latency per token, device memory and host->device bytes vs the full
cache, on a random-weight model of Llama-3.1-8B's shape (no download), following the official `test_latency.py`:

    latency = [T(generate 20 new tokens) - T(generate 2 new tokens)] / 18,   batch 1, repeated, median reported

    python scripts/bench_tailorkv_latency.py --lengths 16000 32000 64000          # on a GPU (fp16, ~16 GB weights)
    python scripts/bench_tailorkv_latency.py --shape tiny --lengths 2000 --device cpu   # a smoke run anywhere

The TailorKV setting is the one the official latency script uses (LongBench: 1 bit, budget 192 = 8 + 56 + 128,
8 channels, layer 0 quantized). Random weights give meaningless text but the real shapes, bytes and kernels.
"""
from __future__ import annotations

import argparse
import statistics

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from kvbench.engine.batching import generate
from kvbench.methods.full import Full
from kvbench.methods.tailorkv import TailorKV
from kvbench.models import AttentionCapture
from shapes import LLAMA3_1_8B  # scripts/shapes.py

SHAPES = {  # Llama-3.1-8B-Instruct's config (rope scaling included), and a tiny stand-in for smoke runs
    "llama3.1-8b": LLAMA3_1_8B,
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=1024, max_position_embeddings=131072),
}


def timed_generate(model, method, ids, budget, new_tokens):
    with AttentionCapture(model) as capture:
        if ids.is_cuda:
            torch.cuda.synchronize()
        gen = generate(model, None, method, capture, ids, budget, new_tokens, eos_ids=set())
        if ids.is_cuda:
            torch.cuda.synchronize()
    return gen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3.1-8b")
    ap.add_argument("--lengths", type=int, nargs="+", default=[16000, 32000])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--bits", type=int, default=1)
    args = ap.parse_args()

    dtype = torch.float16 if args.device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPES[args.shape]), dtype=dtype,
                                                 attn_implementation="sdpa").eval()
    methods = {"full": (Full(), None),
               f"tailorkv-{args.bits}": (TailorKV(bits=args.bits, quant_layers=[0]), 192)}
    print(f"# {args.shape} random weights, {dtype}, {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""))
    print("| length | method | decode s/token | vs full | device KV MiB | host KV MiB | H2D MiB/token "
          "| peak device GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for length in args.lengths:
        ids = torch.randint(0, model.config.vocab_size, (1, length), device=args.device)
        rows = {}
        for name, (method, budget) in methods.items():
            times = []
            for _ in range(args.repeats):
                if args.device == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                long = timed_generate(model, method, ids, budget, 20)
                short = timed_generate(model, method, ids, budget, 2)
                total = lambda g: sum(g.timings[k] for k in ("prefill_s", "compress_s", "decode_s"))  # noqa: E731
                times.append((total(long) - total(short)) / 18)
            peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else float("nan")
            h2d = long.transfers["h2d_bytes_per_token"] if long.transfers else 0.0
            rows[name] = (statistics.median(times), long.kv_bytes, long.host_kv_bytes, h2d, peak)
        full_s = rows["full"][0]
        for name, (s, kv, host, h2d, peak) in rows.items():
            print(f"| {length} | {name} | {s:.4f} | {s / full_s:.2f} | {kv / 2**20:.1f} | {host / 2**20:.1f} | "
                  f"{h2d / 2**20:.1f} | {peak:.1f} |", flush=True)


if __name__ == "__main__":
    main()
