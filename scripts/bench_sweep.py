"""Benchmark (not a test): one sweep through Hydra's basic launcher and through `hydra/launcher=grid`.

The same 8-configuration sweep (4 methods x 2 budgets, the needle grid at one length, the embedded model) runs as
`python -m kvbench.run -m ...` end to end, once per launcher, alternating which goes first on each repetition so a
burst of noise from other processes hits both alike. Prints the wall and CPU seconds of each, the grid / basic
ratios, and whether every run directory got the same predictions (same records apart from timings and memory).

    python scripts/bench_sweep.py [--length 2000] [--depths 0 50 100] [--reps 1]
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


def sweep(launcher: str, results: Path, args) -> tuple[float, float]:
    """Run the sweep into `results`; returns (wall s, CPU s of the child)."""
    cmd = [sys.executable, "-m", "kvbench.run", "-m", f"hydra/launcher={launcher}", f"method={args.methods}",
           f"budget={args.budgets}", f"dataset.context_lengths=[{args.length}]",
           f"dataset.depth_percents=[{','.join(str(d) for d in args.depths)}]", "report=false",
           f"results_dir={results}"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    wall = time.perf_counter() - t0
    if out.returncode:
        sys.exit(f"bench_sweep: the {launcher} sweep failed:\n{out.stderr[-3000:]}")
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
    args = ap.parse_args()

    times: dict[str, list[tuple[float, float]]] = {"basic": [], "grid": []}
    same = True
    with tempfile.TemporaryDirectory(prefix="bench_sweep_") as tmp:
        for rep in range(args.reps):
            order = ("basic", "grid") if rep % 2 == 0 else ("grid", "basic")
            for launcher in order:
                times[launcher].append(sweep(launcher, Path(tmp) / f"{launcher}{rep}", args))
                print(f"# rep {rep} {launcher}: {times[launcher][-1][0]:.1f} s wall, {times[launcher][-1][1]:.1f} s CPU",
                      flush=True)
            basic, grid = predictions(Path(tmp) / f"basic{rep}"), predictions(Path(tmp) / f"grid{rep}")
            same &= basic == grid and len(basic) > 0
        n_dirs, n_samples = len(basic), len(next(iter(basic.values())))
    wall = {k: sum(t[0] for t in v) for k, v in times.items()}
    cpu = {k: sum(t[1] for t in v) for k, v in times.items()}
    print(f"\n## sweep {args.methods} x budgets {args.budgets}, needle grid at {args.length} ({n_samples} samples), "
          f"{n_dirs} run dirs, {args.reps} rep(s), threads={os.environ.get('OMP_NUM_THREADS', 'default')}")
    print("| launcher | wall s | CPU s |")
    print("|---|---|---|")
    for k in ("basic", "grid"):
        print(f"| {k} | {wall[k]:.1f} | {cpu[k]:.1f} |")
    print(f"\ngrid / basic: wall {wall['grid'] / wall['basic']:.3f}, CPU {cpu['grid'] / cpu['basic']:.3f} "
          f"(goal <= 0.35) | identical predictions: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
