"""Benchmark (not a test): one sweep through Hydra's basic launcher and through `hydra/launcher=grid`.

The same 8-configuration sweep (4 methods x 2 budgets, the needle grid at one length, the embedded model) runs as
`python -m kvbench.run -m ...` end to end, through the basic launcher and through the grid at each of
`--grid-batch-sizes` (generations decoded together: a sample's configurations, then the next sample's), in an
order that rotates on each repetition so a burst of noise from other processes hits all alike. Prints the wall and
CPU seconds of each, the ratios to basic, and whether every run directory got the same predictions as basic.
At batch_size 1 the grid decodes every step basic decodes, one generation at a time; only prefills are shared. So
basic's decoding time (its records' `decode_s`) plus the grid's own prefills (each sample's once) over basic's wall
time bounds grid / basic at batch_size 1 from below, were start-up, model load and scoring free; the bench prints
that bound.

    python scripts/bench_sweep.py [--length 2000] [--depths 0 50 100] [--reps 1] [--grid-batch-sizes 1 8]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def sweep(run: str, results: Path, args) -> tuple[float, float]:
    """Run the sweep (`basic` or `grid<batch size>`) into `results`; returns (wall s, CPU s of the child)."""
    launcher = "basic" if run == "basic" else "grid"
    batch_size = 1 if run == "basic" else int(run[4:])
    cmd = [sys.executable, "-m", "kvbench.run", "-m", f"hydra/launcher={launcher}", f"batch_size={batch_size}",
           f"method={args.methods}",
           f"budget={args.budgets}", f"dataset.context_lengths=[{args.length}]",
           f"dataset.depth_percents=[{','.join(str(d) for d in args.depths)}]", "report=false",
           f"results_dir={results}"]
    return timed(cmd, f"the {run} sweep")


def timed(cmd: list[str], what: str) -> tuple[float, float]:
    """Run `cmd` from the repository root (offline Hub); (wall s, CPU s of the child); exit with its stderr if it
    fails."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    wall = time.perf_counter() - t0
    if out.returncode:
        sys.exit(f"{Path(sys.argv[0]).name}: {what} failed:\n{out.stderr[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def predictions(results: Path) -> dict[str, dict[str, str]]:
    """Run dir (relative) -> sample id -> prediction."""
    return {str(p.parent.relative_to(results)): {r["id"]: r["prediction"] for r in map(json.loads, p.open())}
            for p in sorted(results.rglob("predictions.jsonl"))}


def records(results: Path) -> list[dict]:
    return [json.loads(line) for p in sorted(results.rglob("predictions.jsonl")) for line in p.open()]


def decode_seconds(results: Path) -> float:
    """The decoding time the records under `results` report (`decode_s`, summed over samples)."""
    return sum(r.get("decode_s") or 0.0 for r in records(results))


def prefill_seconds(results: Path) -> float:
    """The prefill time of a grid run's records, each shared prefill counted once (`prefill_shared_by`)."""
    return sum((r.get("prefill_s") or 0.0) / (r.get("prefill_shared_by") or 1) for r in records(results))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="full,streamingllm,snapkv,pyramidkv")
    ap.add_argument("--budgets", default="64,128")
    ap.add_argument("--length", type=int, default=2000)
    ap.add_argument("--depths", type=int, nargs="+", default=[0, 50, 100])
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--grid-batch-sizes", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args()

    runs = ["basic"] + [f"grid{b}" for b in args.grid_batch_sizes]
    times: dict[str, list[tuple[float, float]]] = {run: [] for run in runs}
    same = {run: True for run in runs[1:]}
    basic_decode = grid_prefill = 0.0
    with tempfile.TemporaryDirectory(prefix="bench_sweep_") as tmp:
        for rep in range(args.reps):
            order = runs[rep % len(runs):] + runs[:rep % len(runs)]
            for run in order:
                times[run].append(sweep(run, Path(tmp) / f"{run}-{rep}", args))
                print(f"# rep {rep} {run}: {times[run][-1][0]:.1f} s wall, {times[run][-1][1]:.1f} s CPU", flush=True)
            basic = predictions(Path(tmp) / f"basic-{rep}")
            basic_decode += decode_seconds(Path(tmp) / f"basic-{rep}")
            grid_prefill += prefill_seconds(Path(tmp) / f"{runs[1]}-{rep}") if len(runs) > 1 else 0.0
            for run in runs[1:]:
                same[run] &= predictions(Path(tmp) / f"{run}-{rep}") == basic and len(basic) > 0
        n_dirs, n_samples = len(basic), len(next(iter(basic.values())))
    wall = {k: sum(t[0] for t in v) for k, v in times.items()}
    cpu = {k: sum(t[1] for t in v) for k, v in times.items()}
    print(f"\n## sweep {args.methods} x budgets {args.budgets}, needle grid at {args.length} ({n_samples} samples), "
          f"{n_dirs} run dirs, {args.reps} rep(s), threads={os.environ.get('OMP_NUM_THREADS', 'default')}")
    print("| launcher | batch_size | wall s | CPU s | wall / basic | CPU / basic | same predictions as basic |")
    print("|---|---|---|---|---|---|---|")
    for run in runs:
        launcher, batch = ("basic", 1) if run == "basic" else ("grid", int(run[4:]))
        print(f"| {launcher} | {batch} | {wall[run]:.1f} | {cpu[run]:.1f} | {wall[run] / wall['basic']:.3f} | "
              f"{cpu[run] / cpu['basic']:.3f} | {'-' if run == 'basic' else 'yes' if same[run] else 'NO'} |")
    if len(runs) > 1:
        floor = (basic_decode + grid_prefill) / wall["basic"]
        print(f"\nbasic decoded for {basic_decode:.1f} s of its {wall['basic']:.1f} s and the {runs[1]} run prefilled "
              f"for {grid_prefill:.1f} s: a grid decoding one generation at a time takes at least {floor:.3f} of "
              "basic, even with free start-up, model load and scoring")
    print("goal: grid / basic <= 0.30 (issue 21), identical predictions")


if __name__ == "__main__":
    main()
