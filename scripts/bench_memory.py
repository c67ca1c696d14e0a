"""Benchmark (not a test): KV held at peak when each layer is compressed inside the prefill forward
(`compress_after=layer`, the default) vs after the whole prefill (`compress_after=prefill`), on the embedded model.

Per method: `peak_kv_bytes / (compressed cache + one full layer)` (goal <= 1.05 with `layer`), and the process's
peak RSS growth over the prompt's run. Each figure is its own fresh process (the peak RSS of a process never goes
down, and a second method in one process reuses memory the first freed), after a warm-up generation; `--reps` runs
every (method, order) that many times, the orders alternating, and the table gives the median and the spread
(min-max): one run is not a figure on a shared machine.

The children run with glibc's mmap threshold fixed (`MALLOC_MMAP_THRESHOLD_`, 128 KiB): by default glibc raises the
threshold each time a large block is freed, after which blocks of that size come from the heap and stay in the
process's RSS when freed, so the same run read 151 or 432 MiB of growth by chance (SnapKV, 4k, 3 processes). With
the threshold fixed every large tensor is its own mapping, returned when freed, and the growth is the live memory's:
the same figure in every process. `--glibc-default` measures without it (what a user's process sees).

    python scripts/bench_memory.py [--length 4096] [--budget 128] [--reps 3] [--methods snapkv pyramidkv adakv ...]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MMAP_THRESHOLD = 128 * 1024  # glibc's default starting threshold, kept fixed (see the docstring)


def rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def child(order: str, name: str, args) -> None:
    """Run `name` once with `order` after a warm-up, printing one JSON line."""
    import kvbench.methods  # noqa: F401
    from kvbench.data.niah import NeedleHaystack
    from kvbench.engine.batching import generate
    from kvbench.models import AttentionCapture, ModelSpec, load
    from kvbench.registry import METHODS

    import torch

    model, tok = load(ModelSpec(name="bench", path="embedded"))
    sample = NeedleHaystack(context_lengths=[args.length + 165], depth_percents=[50]).build(tok, 100_000)[0]
    ids = torch.tensor([tok(sample.prompt).input_ids])
    with AttentionCapture(model) as capture:  # warm-up on a short prompt: one-time allocations out of the figure
        generate(model, tok, METHODS["full"](), capture, ids[:, :64], None, 2, eos_ids=set())
    method = METHODS[name]()
    before = rss_peak()
    with AttentionCapture(model, window=method.query_window) as capture:
        gen = generate(model, tok, method, capture, ids, args.budget, args.new_tokens, eos_ids=set(),
                       compress_after=order)
    bound = gen.kv_bytes + gen.full_kv_bytes / model.config.num_hidden_layers
    print(json.dumps({"method": name, "order": order, "prompt_tokens": ids.shape[1], "peak_kv": gen.peak_kv_bytes,
                      "kv": gen.kv_bytes, "full_kv": gen.full_kv_bytes, "ratio": gen.peak_kv_bytes / bound,
                      "rss_growth": rss_peak() - before, "prefill_s": gen.timings["prefill_s"]}), flush=True)


def one_run(order: str, name: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", order, name, "--length", str(args.length), "--budget",
           str(args.budget), "--new-tokens", str(args.new_tokens)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}  # this checkout's kvbench
    if not args.glibc_default:
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if out.returncode:
        sys.exit(f"bench_memory: {name} ({order}) failed:\n{out.stderr[-3000:]}")
    return next(json.loads(line) for line in out.stdout.splitlines() if line.startswith("{"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3, help="fresh processes per (method, order), orders alternating")
    ap.add_argument("--methods", nargs="+", default=["snapkv", "pyramidkv", "adakv", "streamingllm"])
    ap.add_argument("--glibc-default", action="store_true", help="keep glibc's dynamic mmap threshold (RSS then "
                    "depends on the allocator's history, not only on what is alive)")
    ap.add_argument("--child", nargs=2, metavar=("ORDER", "METHOD"))
    args = ap.parse_args()
    if args.child:
        return child(*args.child, args)

    runs: dict[tuple[str, str], list[dict]] = {}
    for rep in range(args.reps):
        for order in ("prefill", "layer") if rep % 2 == 0 else ("layer", "prefill"):
            for name in args.methods:
                runs.setdefault((name, order), []).append(one_run(order, name, args))
    mib = 2**20
    first = next(iter(runs.values()))[0]
    print(f"## peak KV at {first['prompt_tokens']} prompt tokens, budget {args.budget} (embedded SmolLM2, "
          f"full cache {first['full_kv'] / mib:.1f} MiB); RSS: median [min-max] of {args.reps} fresh processes, "
          f"{'glibc default' if args.glibc_default else f'mmap threshold fixed at {MMAP_THRESHOLD // 1024} KiB'}")
    print("| method | order | compressed MiB | peak KV MiB | peak / (compressed + one layer) | peak RSS growth MiB |")
    print("|---|---|---|---|---|---|")
    for (name, order), rows in runs.items():
        growth = sorted(r["rss_growth"] / mib for r in rows)
        r = rows[0]  # (the KV figures are exact: the same in every rep)
        print(f"| {name} | {order} | {r['kv'] / mib:.2f} | {r['peak_kv'] / mib:.2f} | {r['ratio']:.3f} | "
              f"{statistics.median(growth):.0f} [{growth[0]:.0f}-{growth[-1]:.0f}] |")
    worst = max(r["ratio"] for (_, order), rows in runs.items() if order == "layer" for r in rows)
    print(f"\nlayer order: worst peak / (compressed + one layer) = {worst:.3f} (goal <= 1.05)")


if __name__ == "__main__":
    main()
