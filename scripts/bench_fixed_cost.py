"""Benchmark (not a test): what one `python -m kvbench.run` process costs besides its model time.

The one-sample NIAH run of issue 34 (`method=snapkv budget=64 dataset.context_lengths=[300] dataset.depth_percents=[0]`,
the embedded model, `report` on as by default) runs `--reps` times, each a fresh process writing into a fresh results
folder. Its wall time (spawn to exit, as the parent sees it) minus its record's model time (prefill_s + compress_s +
decode_s) is the process's fixed cost; goal <= 4 s. `--tree DIR` (repeatable) runs the same command from other
checkouts too (PYTHONPATH and working directory set to each), the trees alternating rep by rep, so that a before and
an after share one run and one machine load.

Then, per tree, a probe process repeats the run's steps in the CLI's order and times each (wall, and the part spent in
imports, counted at the outermost `__import__` / `importlib.import_module`): the kvbench.runs / Hydra imports, the
command-line check, Hydra's composition of the job and `setup`, transformers' modelling imports, the model load,
the data, the sample (its model time and the rest: scoring), the report, the interpreter's exit. It follows the
tree's own code (the collector handling of kvbench.runs.run where it has it). Last, a floor: a process that does
only what no kvbench change can remove (import Hydra, torch and transformers' modelling code, load the model from
its safetensors cache, exit with the collector off).

    python scripts/bench_fixed_cost.py [--reps 3] [--tree ../main] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ["method=snapkv", "budget=64", "dataset.context_lengths=[300]", "dataset.depth_percents=[0]"]
GOAL_S = 4.0

# The probe: the CLI's steps (kvbench.runs.run.cli -> main -> run_locked), one at a time, timed.
PROBE = r"""
import builtins, contextlib, gc, importlib, json, sys, time
T0_WALL, T0 = time.time(), time.perf_counter()
in_imports = [0.0, False]

def timed(original):
    def call(*args, **kwargs):
        if in_imports[1]:
            return original(*args, **kwargs)
        in_imports[1], t = True, time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            in_imports[0] += time.perf_counter() - t
            in_imports[1] = False
    return call

builtins.__import__ = timed(builtins.__import__)
importlib.import_module = timed(importlib.import_module)
phases, mark = [], [T0, 0.0]

def phase(name):
    now = time.perf_counter()
    phases.append((name, now - mark[0], in_imports[0] - mark[1]))
    mark[:] = [now, in_imports[0]]

argv, report_dir = sys.argv[1:-1], sys.argv[-1]
import kvbench.runs.run as R
phase("imports of kvbench.runs.run (Hydra, OmegaConf)")
owns_gc = hasattr(R, "started")  # this tree's CLI owns the collector
paused = getattr(R, "collector_paused", contextlib.nullcontext)
with paused():
    argv = R.check_command_line(argv)
if owns_gc:
    R.started()
phase("command-line check (validation: torch, transformers core, methods; compose; setup)")
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf
from kvbench.runs.config import CONFIG_DIR, setup
with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3", job_name="run"):
    cfg = compose("config", overrides=argv, return_hydra_config=True)
HydraConfig.instance().set_config(cfg)
method, dataset, spec = setup(cfg)
phase("Hydra's composition of the job, setup")
with paused():
    from kvbench.models import AttentionCapture, load
    phase("transformers' modelling imports (kvbench.models.capture)")
    model, tokenizer = load(spec)
    phase("model load (tokenizer + weights)")
    method.prepare(model, tokenizer, prefill=__import__("kvbench.engine.generation", fromlist=["x"]).prefill)
    samples = dataset.build(tokenizer, spec.max_prompt_tokens, chat_template=spec.chat_template)
    phase("data (dataset.build)")
from kvbench.engine.generation import Sampling
sampling = Sampling(**OmegaConf.to_container(cfg.generation, resolve=True), seed=cfg.seed)
with AttentionCapture(model, window=method.query_window) as capture:
    record = R.guarded_sample(model, tokenizer, method, capture, dataset, samples[0], cfg, spec, sampling)
model_s = sum(record.get(k) or 0.0 for k in ("prefill_s", "compress_s", "decode_s"))
now = time.perf_counter()
phases.append(("the sample: model time (its record)", model_s, 0.0))
phases.append(("the sample: the rest (scoring, record)", now - mark[0] - model_s, in_imports[0] - mark[1]))
mark[:] = [now, in_imports[0]]
from kvbench.report import write_run_report
with paused():
    write_run_report(report_dir)
phase("report (summary.md, heatmap.png)")
print(json.dumps({"t0": T0_WALL, "phases": phases, "end": time.time()}), flush=True)
if owns_gc:
    gc.freeze()
"""

FLOOR = r"""
import gc, time
gc.disable()
import hydra, omegaconf, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
import transformers.models.llama.modeling_llama
from kvbench.models.embedded import embedded_model_dir
source = str(embedded_model_dir())
tokenizer = AutoTokenizer.from_pretrained(source)
model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, attn_implementation="sdpa").eval()
gc.freeze()
"""


def env_for(tree: Path, threads: int | None) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(tree)}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def child(cmd: list[str], tree: Path, threads: int | None, what: str) -> tuple[float, float, str]:
    """Run `cmd` in `tree`; (wall s from spawn to exit, CPU s of the child, stdout)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=tree, env=env_for(tree, threads), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if out.returncode:
        sys.exit(f"bench_fixed_cost: {what} failed in {tree}:\n{out.stderr[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), out.stdout


def the_record(results: Path) -> dict:
    (path,) = results.rglob("predictions.jsonl")
    return json.loads(path.read_text().splitlines()[0])


def model_seconds(record: dict) -> float:
    return sum(record.get(k) or 0.0 for k in ("prefill_s", "compress_s", "decode_s"))


def label(tree: Path) -> str:
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=tree, capture_output=True,
                           text=True).stdout.strip()
    return f"{tree.name}@{sha.strip() or '?'}{'+' if dirty else ''}"


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tree", type=Path, action="append", default=[],
                    help="another checkout to run the same command from (repeatable); this one is always run")
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for the children (default: unset)")
    ap.add_argument("--no-probe", action="store_true", help="skip the per-step breakdown and the floor")
    args = ap.parse_args()

    trees = [t.resolve() for t in args.tree] + [ROOT]
    names = [label(t) for t in trees]
    runs: dict[Path, list[tuple[float, float, float]]] = {t: [] for t in trees}  # (wall, CPU, model) per rep
    with tempfile.TemporaryDirectory(prefix="bench_fixed_cost_") as tmp:
        report_dirs = {}
        for rep in range(args.reps):
            order = trees[rep % len(trees):] + trees[:rep % len(trees)]
            for tree, name in ((t, names[trees.index(t)]) for t in order):
                results = Path(tmp) / f"{trees.index(tree)}-{rep}"
                wall, cpu, _ = child([sys.executable, "-m", "kvbench.run", *COMMAND, f"results_dir={results}"], tree,
                                     args.threads, "the one-sample run")
                model = model_seconds(the_record(results))
                runs[tree].append((wall, cpu, model))
                report_dirs.setdefault(tree, next(results.rglob("predictions.jsonl")).parent)
                print(f"# rep {rep} {name}: {wall:.2f} s wall, {cpu:.2f} s CPU, model {model:.2f} s, "
                      f"fixed {wall - model:.2f} s", flush=True)

        print(f"\n## one-sample NIAH run ({' '.join(COMMAND)}), fresh process each, {args.reps} rep(s) per tree, "
              f"median [min-max], threads={args.threads or 'default'}, load average before the table "
              f"{os.getloadavg()[0]:.1f}")
        print("| code | wall s | CPU s | model s (record) | wall - model s | goal |")
        print("|---|---|---|---|---|---|")
        for tree, name in zip(trees, names):
            walls, cpus, models = (list(x) for x in zip(*runs[tree]))
            fixed = [w - m for w, m in zip(walls, models)]
            ok = "met" if statistics.median(fixed) <= GOAL_S else "not met"
            print(f"| {name} | {spread(walls)} | {spread(cpus)} | {spread(models)} | **{spread(fixed)}** | "
                  f"<= {GOAL_S:.0f} s: {ok} |")
        if len(trees) > 1:
            base, new = (statistics.median(w - m for w, _, m in runs[t]) for t in (trees[0], trees[-1]))
            print(f"\n{names[-1]} / {names[0]} fixed cost: {new / base:.3f} ({base - new:+.2f} s)")
        if args.no_probe:
            return

        for tree, name in zip(trees, names):
            report_dir = Path(tmp) / f"report-{trees.index(tree)}"
            shutil.copytree(report_dirs[tree], report_dir)
            results = Path(tmp) / f"probe-{trees.index(tree)}"
            t_spawn = time.time()
            wall, cpu, out = child([sys.executable, "-c", PROBE, *COMMAND, f"results_dir={results}",
                                    str(report_dir)], tree, args.threads, "the probe")
            t_exit = time.time()
            probe = json.loads(out.strip().splitlines()[-1])
            rows = [("interpreter start (spawn to the first line)", probe["t0"] - t_spawn, 0.0), *probe["phases"],
                    ("interpreter exit (the last line to exit)", t_exit - probe["end"], 0.0)]
            print(f"\n## where the seconds go: {name} (one probe process, {wall:.2f} s wall, {cpu:.2f} s CPU)")
            print("| step | wall s | of which imports s |")
            print("|---|---|---|")
            for step, seconds, imports in rows:
                print(f"| {step} | {seconds:.2f} | {imports:.2f} |")
            print(f"| all imports | | {sum(r[2] for r in rows):.2f} |")

        walls = [child([sys.executable, "-c", FLOOR], ROOT, args.threads, "the floor")[0] for _ in range(2)]
        print(f"\nfloor (a process that imports Hydra, torch and transformers' modelling code, loads the model from its "
              f"safetensors cache and exits, collector off): {min(walls):.2f} s wall (best of 2); no kvbench change "
              f"goes below it, so a run's fixed cost is at least that")


if __name__ == "__main__":
    main()
