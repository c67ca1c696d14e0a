"""Benchmark (not a test): KV held at peak when each layer is compressed inside the prefill forward
(`compress_after=layer`, the default) vs after the whole prefill (`compress_after=prefill`), on the embedded model.

Per method: `peak_kv_bytes / (compressed cache + one full layer)` (goal <= 1.05 with `layer`), and per order the
process's peak RSS growth over the prompt's run (one fresh process per order, since the peak RSS of a process never
goes down; the first method's growth is the clean figure, later ones reuse freed memory).

    python scripts/bench_memory.py [--length 4096] [--budget 128] [--methods snapkv pyramidkv adakv streamingllm]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def child(order: str, args) -> None:
    """Run every method once with `order`, printing one JSON line per method."""
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
    n_layers = model.config.num_hidden_layers
    for name in args.methods:
        method = METHODS[name]()
        before = rss_peak()
        window = method.query_window
        with AttentionCapture(model, window=window) as capture:
            gen = generate(model, tok, method, capture, ids, args.budget, args.new_tokens, eos_ids=set(),
                           compress_after=order)
        bound = gen.kv_bytes + gen.full_kv_bytes / n_layers
        print(json.dumps({"method": name, "order": order, "prompt_tokens": ids.shape[1], "peak_kv": gen.peak_kv_bytes,
                          "kv": gen.kv_bytes, "full_kv": gen.full_kv_bytes, "ratio": gen.peak_kv_bytes / bound,
                          "rss_growth": rss_peak() - before, "prefill_s": gen.timings["prefill_s"]}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--methods", nargs="+", default=["snapkv", "pyramidkv", "adakv", "streamingllm"])
    ap.add_argument("--child", choices=["layer", "prefill"])
    args = ap.parse_args()
    if args.child:
        return child(args.child, args)

    rows = []
    for order in ("prefill", "layer"):
        cmd = [sys.executable, __file__, "--child", order, "--length", str(args.length), "--budget", str(args.budget),
               "--new-tokens", str(args.new_tokens), "--methods", *args.methods]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}  # this checkout's kvbench
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
        if out.returncode:
            sys.exit(f"bench_memory: the {order} run failed:\n{out.stderr[-3000:]}")
        rows += [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    mib = 2**20
    print(f"## peak KV at {rows[0]['prompt_tokens']} prompt tokens, budget {args.budget} (embedded SmolLM2, "
          f"full cache {rows[0]['full_kv'] / mib:.1f} MiB)")
    print("| method | order | compressed MiB | peak KV MiB | peak / (compressed + one layer) | peak RSS growth MiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['order']} | {r['kv'] / mib:.2f} | {r['peak_kv'] / mib:.2f} | {r['ratio']:.3f} | "
              f"{r['rss_growth'] / mib:.0f} |")
    first = {r["order"]: r for r in rows if r["method"] == args.methods[0]}
    worst = max(r["ratio"] for r in rows if r["order"] == "layer")
    print(f"\nlayer order: worst peak / (compressed + one layer) = {worst:.3f} (goal <= 1.05); peak RSS growth "
          f"({args.methods[0]}, first in each process): layer {first['layer']['rss_growth'] / mib:.0f} MiB vs prefill "
          f"{first['prefill']['rss_growth'] / mib:.0f} MiB")


if __name__ == "__main__":
    main()
