"""Benchmark (not a test): prefill, compression and per-token decode time, and KV bytes, per method relative to
`full`, on the embedded SmolLM2 at 4k and 8k tokens. All methods are measured in one run, interleaved, so the
ratios are comparable even on a noisy shared machine; absolute times only mean something on a dedicated GPU.

    python scripts/bench_methods.py [--lengths 4096 8192] [--budget 128] [--new-tokens 32] [--reps 1]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import kvbench.methods  # noqa: F401
from kvbench.data.niah import NeedleHaystack
from kvbench.engine.batching import generate
from kvbench.models import AttentionCapture, ModelSpec, load
from kvbench.registry import METHODS

METHOD_ARGS = {"full": {}, "streamingllm": {}, "snapkv": {}, "pyramidkv": {}}


def foreign_load(t0_proc: tuple, t0_wall: float) -> float:
    """Share of both cores used by other processes since (t0_proc, t0_wall), from /proc/stat minus our own CPU."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = sum(fields) - fields[3] - fields[4]
    ticks = os.sysconf("SC_CLK_TCK")
    own = sum(os.times()[:2])
    return max(0.0, ((busy - t0_proc[0]) / ticks - (own - t0_proc[1])) / ((time.time() - t0_wall) * os.cpu_count()))


def snapshot() -> tuple:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4], sum(os.times()[:2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--model", default="embedded")
    args = ap.parse_args()

    model, tok = load(ModelSpec(name="bench", path=args.model))
    device = next(model.parameters()).device
    print(f"# device={device} threads={torch.get_num_threads()} budget={args.budget} new_tokens={args.new_tokens}")
    for length in args.lengths:
        sample = NeedleHaystack(context_lengths=[length + 165], depth_percents=[50]).build(tok, 100_000)[0]
        ids = torch.tensor([tok(sample.prompt).input_ids], device=device)
        rows: dict[str, list] = {name: [] for name in METHOD_ARGS}
        with AttentionCapture(model) as capture:  # warm-up: the first forward at a new length pays allocation costs
            generate(model, tok, METHODS["full"](), capture, ids, None, 2, eos_ids=set())
        t0 = (snapshot(), time.time())
        for _ in range(args.reps):
            for name, kw in METHOD_ARGS.items():  # interleaved: a burst of noise hits every method alike
                method = METHODS[name](**kw)
                window = method.query_window
                with AttentionCapture(model, window=window) as capture:
                    gen = generate(model, tok, method, capture, ids, args.budget, args.new_tokens, eos_ids=set())
                steps = max(len(gen.token_ids) - 1, 1)
                rows[name].append((gen.timings["prefill_s"], gen.timings["compress_s"],
                                   gen.timings["decode_s"] / steps, gen.kv_bytes))
        load_share = foreign_load(*t0)
        full = [statistics.median(x) for x in zip(*rows["full"])]
        print(f"\n## prompt {ids.shape[1]} tokens (foreign CPU load {load_share:.2f})")
        print("| method | prefill s | compress s | decode ms/tok | KV MiB | prefill vs full | decode vs full | KV vs full |")
        print("|---|---|---|---|---|---|---|---|")
        for name, values in rows.items():
            p, c, d, b = (statistics.median(x) for x in zip(*values))
            print(f"| {name} | {p:.2f} | {c:.3f} | {1000 * d:.1f} | {b / 2**20:.2f} | {p / full[0]:.2f} | "
                  f"{d / full[2]:.2f} | {b / full[3]:.3f} |")


if __name__ == "__main__":
    main()
