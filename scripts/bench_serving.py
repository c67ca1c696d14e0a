"""Benchmark (not a test): what SnapKV buys under load at a fixed KV pool, on the embedded SmolLM2, in one run.

A short NIAH set (`--n` samples at `--length` tokens, 30 new tokens each) is replayed all at once into kvbench's
engine under a KV pool sized for `--pool-requests` full-cache requests (kvbench.serving). Printed side by side for
full and SnapKV at `--budget`: the reservation per request, the admitted concurrency (the most requests running at
once) against the pool's prediction (full bytes / compressed bytes), output tokens/s and requests/s, latencies and
accuracy. Last, the ceiling: transformers' own forward (greedy, its dense `DynamicCache`) on the same prompts at
batch M (SnapKV's concurrency) over batch N (full's), tokens/s ratio with the batched prefill included and of the
decode steps alone; and the gain SnapKV reached as a share of each. Both methods run in this one process, one after the other, so the ratio is
comparable on a noisy shared machine; `--reps` repeats the ceiling and keeps each batch size's best.

    python scripts/bench_serving.py [--n 10] [--length 1000] [--budget 128] [--pool-requests 1] [--reps 2]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from kvbench.runs.api import Engine, RunSpec
from kvbench.serving.__main__ import table
from kvbench.serving.bench import ServingSpec, run_load


def depths(n: int) -> str:
    return "[" + ",".join(str(round(100 * i / max(1, n - 1))) for i in range(n)) + "]"


def hf_tok_s(model, prompts: list[list[int]], batch: int, new_tokens: int) -> tuple[float, float]:
    """transformers' own forward, greedy, over `batch` prompts cut to one length (no padding) with its dense
    `DynamicCache`: output tokens/s with the batched prefill included, and of the decode steps alone."""
    from transformers import DynamicCache

    n = min(len(p) for p in prompts[:batch])
    ids = torch.tensor([p[:n] for p in prompts[:batch]])
    cache = DynamicCache(config=model.config)
    t0 = time.perf_counter()
    with torch.no_grad():
        token = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        t1 = time.perf_counter()
        for t in range(new_tokens - 1):
            position = torch.full((batch, 1), n + t)
            token = model(token, past_key_values=cache, position_ids=position, use_cache=True).logits.argmax(-1)
    t2 = time.perf_counter()
    return batch * new_tokens / (t2 - t0), batch * (new_tokens - 1) / (t2 - t1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--length", type=int, default=1000)
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--pool-requests", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    data = (f"dataset.context_lengths=[{args.length}]", f"dataset.depth_percents={depths(args.n)}")
    summaries, loaded, prompts, new_tokens = [], None, None, 30
    with tempfile.TemporaryDirectory() as out:
        for method in ("full", "snapkv"):
            run = RunSpec(method=method, budget=args.budget, overrides=data).validate()
            with Engine(run, loaded=loaded) as engine:
                loaded = engine.model, engine.tokenizer
                summaries.append(run_load(engine, ServingSpec(pool_requests=args.pool_requests),
                                          Path(out) / method))
                prompts = [r.input_ids[0].tolist() for r in map(engine.sample_request, engine.samples())]
                new_tokens = engine.samples()[0].max_new_tokens
    full, snap = summaries
    print(table(summaries))
    predicted = full["kv_reserved_bytes_mean"] / snap["kv_reserved_bytes_mean"]
    m, n = snap["peak_running"], full["peak_running"]
    model = loaded[0]
    best = {b: (0.0, 0.0) for b in (n, m)}
    for rep in range(args.reps):  # forwards then backwards, each size's best
        for b in ((n, m) if rep % 2 == 0 else (m, n)):
            best[b] = tuple(map(max, best[b], hf_tok_s(model, prompts, b, new_tokens)))
    gain = snap["output_tok_s"] / full["output_tok_s"]
    print(f"\npool {full['pool_bytes']:,} bytes = {args.pool_requests} full-cache requests of {args.length}-token "
          f"NIAH prompts + {new_tokens} new tokens")
    print(f"reserved per request: full {full['kv_reserved_bytes_mean']:,.0f} B, snapkv b{args.budget} "
          f"{snap['kv_reserved_bytes_mean']:,.0f} B (ratio {predicted:.2f})")
    print(f"admitted concurrency: full {n}, snapkv {m} ({m / n:.2f}x; the pool predicts {predicted:.2f}x, whole "
          f"requests: {int(full['pool_bytes'] // snap['kv_reserved_bytes_mean'])} of at most {args.n})")
    print(f"throughput: full {full['output_tok_s']:.2f} tok/s, snapkv {snap['output_tok_s']:.2f} tok/s: gain "
          f"{gain:.2f}x (requests/s {snap['requests_s'] / full['requests_s']:.2f}x)")
    for i, what in enumerate(("prefill included", "decode steps only")):
        ceiling = best[m][i] / best[n][i]
        print(f"ceiling ({what}): transformers batch {m} {best[m][i]:.2f} tok/s over batch {n} {best[n][i]:.2f} "
              f"tok/s = {ceiling:.2f}x; snapkv's gain is {100 * gain / ceiling:.0f}% of it")


if __name__ == "__main__":
    main()
