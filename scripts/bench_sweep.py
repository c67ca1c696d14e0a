"""Benchmark (not a test): one sweep through Hydra's basic launcher and through `hydra/launcher=grid`.

The same 8-configuration sweep (4 methods x 2 budgets, the needle grid at one length, the embedded model) runs as
`python -m kvbench.run -m ...` end to end, through the basic launcher and through the grid at each of
`--grid-batch-sizes` (generations decoded together: a sample's configurations, then the next sample's), in an
order that rotates on each repetition so a burst of noise from other processes hits all alike. Prints the wall and
CPU seconds of each, the ratios to basic, and whether every run directory got the same predictions as basic.

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
    with tempfile.TemporaryDirectory(prefix="bench_sweep_") as tmp:
        for rep in range(args.reps):
            order = runs[rep % len(runs):] + runs[:rep % len(runs)]
            for run in order:
                times[run].append(sweep(run, Path(tmp) / f"{run}-{rep}", args))
                print(f"# rep {rep} {run}: {times[run][-1][0]:.1f} s wall, {times[run][-1][1]:.1f} s CPU", flush=True)
            basic = predictions(Path(tmp) / f"basic-{rep}")
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
    print("\ngoal: grid / basic <= 0.35 at batch_size 1, identical predictions")


if __name__ == "__main__":
    main()
