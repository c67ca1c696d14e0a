"""Benchmark (not a test): end-to-end wall time of a NIAH run at batch_size 1 vs 8 (and any others given).

Each batch size runs `python -m kvbench.run dataset=niah method=<m> budget=<b> batch_size=<B>` as its own process
over the same 24 samples (6 lengths x 4 depths, prompts of about 300-2000 tokens of the embedded model), so the
time includes start-up, model load, prefills, decoding, scoring and writing, as a user sees it. Batch sizes run in
an order that rotates on each repetition, so a burst of load from other processes hits all alike. Prints wall and
CPU seconds, the ratio to batch 1 and whether the predictions equal batch 1's, and the most any batching of the
decode can give: batch 1's wall time over that time less its records' `decode_s` (what is left if decoding cost
nothing: start-up, model load, prefill, compression, scoring; Amdahl's bound on the speed-up).

    python scripts/bench_niah_batch.py [--method snapkv] [--budget 128] [--batch-sizes 1 8] [--reps 1]

`--multiturn append|reset`: `dataset=niah_multiturn` at its defaults instead (8 conversations of 4 turns over
contexts of 1,000 and 2,000 tokens, 16 new tokens per answer), the conversations decoded together at batch_size > 1.
Predictions are compared per sample id (batched runs write records in completion order).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from bench_sweep import decode_seconds, predictions, timed

LENGTHS = [465, 805, 1145, 1485, 1825, 2165]  # NIAH lengths in model tokens; the prompt is about L - 165
DEPTHS = [0, 33, 66, 100]


def run(batch_size: int, results: Path, args) -> tuple[float, float]:
    """One end-to-end run; returns (wall s, CPU s of the child)."""
    if args.multiturn:
        data = ["dataset=niah_multiturn", f"dataset.turn_mode={args.multiturn}"]
    else:
        data = ["dataset=niah", f"dataset.context_lengths=[{','.join(map(str, LENGTHS))}]",
                f"dataset.depth_percents=[{','.join(map(str, DEPTHS))}]"]
    cmd = [sys.executable, "-m", "kvbench.run", *data, f"method={args.method}", f"budget={args.budget}",
           f"batch_size={batch_size}", "report=false", f"results_dir={results}"]
    return timed(cmd, f"batch_size={batch_size}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="snapkv")
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--multiturn", choices=["append", "reset"], default=None)
    args = ap.parse_args()
    sizes = args.batch_sizes
    wall, cpu, same = {b: 0.0 for b in sizes}, {b: 0.0 for b in sizes}, {b: True for b in sizes}
    decode_first = 0.0
    with tempfile.TemporaryDirectory(prefix="bench_niah_batch_") as tmp:
        for rep in range(args.reps):
            for b in sizes[rep % len(sizes):] + sizes[:rep % len(sizes)]:
                w, c = run(b, Path(tmp) / f"b{b}-{rep}", args)
                wall[b], cpu[b] = wall[b] + w, cpu[b] + c
                if b == sizes[0]:
                    decode_first += decode_seconds(Path(tmp) / f"b{b}-{rep}")
                print(f"# rep {rep} batch_size={b}: {w:.1f} s wall, {c:.1f} s CPU", flush=True)
            first = predictions(Path(tmp) / f"b{sizes[0]}-{rep}")
            for b in sizes:
                got = predictions(Path(tmp) / f"b{b}-{rep}")
                same[b] &= got == first and len(first) > 0
    n = len(next(iter(first.values()), {}))
    what = f"niah_multiturn ({args.multiturn})" if args.multiturn else "NIAH"
    print(f"\n## {what} end to end, {args.method} budget {args.budget}, {n} samples, {args.reps} rep(s), "
          f"threads={os.environ.get('OMP_NUM_THREADS', 'default')}")
    print(f"| batch_size | wall s | CPU s | speed-up vs batch {sizes[0]} | same predictions |")
    print("|---|---|---|---|---|")
    for b in sizes:
        print(f"| {b} | {wall[b]:.1f} | {cpu[b]:.1f} | {wall[sizes[0]] / wall[b]:.2f}x | {'yes' if same[b] else 'NO'} |")
    first = wall[sizes[0]]
    print(f"\nbatch {sizes[0]} decoded for {decode_first:.1f} s of its {first:.1f} s: batching the decode can speed "
          f"the run up by at most {first / (first - decode_first):.2f}x (the rest is start-up, prefill and scoring)")
    print("goal: batch 8 >= 2x batch 1 (issue 21)")


if __name__ == "__main__":
    main()
