"""Benchmark (not a test): what compression buys under load at a fixed KV pool, against what batching allows.

On the embedded SmolLM2, a dataset's requests arrive at once into kvbench's engine under a KV pool sized for
`--pool-requests` full-cache requests (kvbench.serving). The full cache and the compressed method run under the same
pool, one after the other in this process; printed side by side: each one's reservation per request, the admitted
concurrency (N for the full cache, M for the method: the most requests running at once) against the pool's
prediction (full bytes / compressed bytes), output tokens/s, requests/s, mean output length (inflation), accuracy;
then the ceiling: transformers' own `generate` (the plain model, no kvbench capture, its dense cache) on the same
prompts at batch M over batch N, each side with its method's mean output length (kvbench.serving.ceiling; sizes
alternated over `--reps`, each size's best kept), and the method's gain as a share of it.

Presets (`--preset`):
  niah   SnapKV at budget 128 on NIAH at `--length` tokens (12 depths), the newline stop off and EOS held off
         (`serving.ignore_eos`) so that each request decodes `--new-tokens` tokens (decode-dominated, as the ceiling
         is);
  gsm8k  H2O at budget 128 on GSM8K (lm-eval's gsm8k_cot prompt: the 8 chain-of-thought exemplars, 256 new tokens,
         its stop strings): reasoning outputs, where a decode-time evictor's output inflation shows. `--gsm8k-root`
         reads test.jsonl/train.jsonl there; without it, `--n` self-written grade-school problems (look-alikes, not
         GSM8K's) with the few-shot pool of tests/fixtures/gsm8k.

    python scripts/bench_serving.py --preset niah [--n 12] [--length 1000] [--new-tokens 96] [--pool-requests 1]
    python scripts/bench_serving.py --preset gsm8k [--n 18] [--budget 128] [--json out.json]
    python scripts/bench_serving.py --plot docs/figures/serving_ceiling.png niah.json gsm8k.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import torch

from kvbench.runs.api import Engine, RunSpec
from kvbench.serving.__main__ import table
from kvbench.serving.bench import ServingSpec, run_load
from kvbench.serving.ceiling import ceiling

ROOT = Path(__file__).resolve().parents[1]


def depths(n: int) -> str:
    return "[" + ",".join(str(round(100 * i / max(1, n - 1))) for i in range(n)) + "]"


def grade_school_problems(folder: Path, n: int, seed: int = 0) -> None:
    """`n` two-step word problems in GSM8K's test.jsonl format (self-written templates), and the fixture's train
    split as the few-shot pool."""
    rng = random.Random(seed)
    names, things = ["Ana", "Ben", "Chen", "Dora", "Eli", "Fay"], ["apples", "pens", "stamps", "cookies", "marbles"]
    with open(folder / "test.jsonl", "w") as f:
        for i in range(n):
            who, what = names[i % len(names)], things[i % len(things)]
            a, b, c = rng.randint(3, 9), rng.randint(4, 12), rng.randint(2, 15)
            q = (f"{who} has {a} boxes with {b} {what} in each box. {who} gives away {c} {what}. "
                 f"How many {what} does {who} have left?")
            ans = f"{who} has {a} * {b} = <<{a}*{b}={a * b}>>{a * b} {what}.\n" \
                  f"After giving away {c}, {a * b} - {c} = <<{a * b}-{c}={a * b - c}>>{a * b - c}.\n#### {a * b - c}"
            f.write(json.dumps({"question": q, "answer": ans}) + "\n")
    shutil.copy(ROOT / "tests" / "fixtures" / "gsm8k" / "train.jsonl", folder / "train.jsonl")


def preset(args, tmp: Path) -> tuple[str, str, tuple[str, ...]]:
    """(dataset, method, overrides) of the chosen preset."""
    if args.preset == "niah":
        return "niah", args.method or "snapkv", (
            f"dataset.context_lengths=[{args.length}]", f"dataset.depth_percents={depths(args.n)}",
            f"dataset.max_new_tokens={args.new_tokens}", "dataset.stop=[]")
    root = args.gsm8k_root
    if root is None:
        root = tmp / "gsm8k"
        root.mkdir()
        grade_school_problems(root, args.n)
    return "gsm8k", args.method or "h2o", (f"dataset.root={root}", f"dataset.max_new_tokens={args.new_tokens}",
                                           "dataset.protocol=gsm8k_cot")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=("niah", "gsm8k"), default="niah")
    ap.add_argument("--method", default=None, help="the compressed method (niah: snapkv, gsm8k: h2o)")
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--n", type=int, default=None, help="requests (niah: 12, gsm8k: 18)")
    ap.add_argument("--length", type=int, default=1000, help="niah: context length in tokens")
    ap.add_argument("--new-tokens", type=int, default=None, help="max new tokens (niah: 96, gsm8k: 256)")
    ap.add_argument("--gsm8k-root", type=Path, default=None)
    ap.add_argument("--pool-requests", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    ap.add_argument("--plot", type=Path, nargs="+", default=None, metavar=("PNG", "JSON"),
                    help="only draw PNG from the --json files of earlier runs (docs/figures/serving_ceiling.png)")
    args = ap.parse_args()
    if args.plot:
        from kvbench.serving.plots import write_ceiling_figure

        print(f"wrote {write_ceiling_figure([json.loads(p.read_text()) for p in args.plot[1:]], args.plot[0])}")
        return
    args.n = args.n or (12 if args.preset == "niah" else 18)  # (whole waves of the admitted concurrency)
    args.new_tokens = args.new_tokens or (96 if args.preset == "niah" else 256)
    torch.set_num_threads(1)
    summaries, loaded, prompts = [], None, None
    with tempfile.TemporaryDirectory() as tmp:
        dataset, method, data = preset(args, Path(tmp))
        for name in ("full", method):
            run = RunSpec(method=name, budget=args.budget, dataset=dataset, overrides=data).validate()
            with Engine(run, loaded=loaded) as engine:
                loaded = engine.model, engine.tokenizer
                summaries.append(run_load(engine, ServingSpec(pool_requests=args.pool_requests, limit=args.n,
                                                      ignore_eos=args.preset == "niah"),
                                          Path(tmp) / name))
                prompts = [r.input_ids[0].tolist() for r in map(engine.sample_request, engine.samples(args.n))]
        full, comp = summaries
        for s in summaries:  # output lengths, from the records
            records = [json.loads(line) for line in (Path(s["run_dir"]) / "predictions.jsonl").read_text().splitlines()]
            s["output_tokens_mean"] = sum(r["serving"]["output_tokens"] for r in records if "serving" in r) / s["n"]
    print(table(summaries))
    n, m = full["peak_running"], comp["peak_running"]
    t_n, t_m = round(full["output_tokens_mean"]), round(comp["output_tokens_mean"])
    ceil = ceiling(loaded[0], prompts, m, n, max(t_m, 2), max(t_n, 2), reps=args.reps)
    predicted = full["kv_reserved_bytes_mean"] / comp["kv_reserved_bytes_mean"]
    gain = comp["output_tok_s"] / full["output_tok_s"]
    label = f"{method} b{args.budget}"
    print(f"\n{dataset}: {args.n} requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, at most "
          f"{args.new_tokens} new; pool {full['pool_bytes']:,} bytes = {args.pool_requests} full-cache requests; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    rows = [("reserved bytes per request", f"{full['kv_reserved_bytes_mean']:,.0f}",
             f"{comp['kv_reserved_bytes_mean']:,.0f}", f"{predicted:.2f}x (expected admission ratio)"),
            ("admitted concurrency (peak running)", n, m, f"{m / n:.2f}x"),
            ("output tokens per request (mean)", f"{full['output_tokens_mean']:.1f}",
             f"{comp['output_tokens_mean']:.1f}", f"{comp['output_tokens_mean'] / full['output_tokens_mean']:.2f}x"),
            ("kvbench output tok/s", f"{full['output_tok_s']:.2f}", f"{comp['output_tok_s']:.2f}", f"gain {gain:.2f}x"),
            ("kvbench requests/s", f"{full['requests_s']:.3f}", f"{comp['requests_s']:.3f}",
             f"{comp['requests_s'] / full['requests_s']:.2f}x"),
            ("accuracy", f"{full['accuracy']['mean']:.3f}", f"{comp['accuracy']['mean']:.3f}", ""),
            (f"transformers generate tok/s (batch {n} | {m})", f"{ceil.n.tok_s:.2f}", f"{ceil.m.tok_s:.2f}",
             f"ceiling {ceil.ratio:.2f}x"),
            ("transformers decode-only tok/s", f"{ceil.n.decode_tok_s:.2f}", f"{ceil.m.decode_tok_s:.2f}",
             f"{ceil.decode_ratio:.2f}x"),
            ("kvbench / transformers at its concurrency", f"{full['output_tok_s'] / ceil.n.tok_s:.2f}",
             f"{comp['output_tok_s'] / ceil.m.tok_s:.2f}", "(their ratio is gain / ceiling)"),
            ("gain / ceiling", "", "", f"{100 * gain / ceil.ratio:.0f}%")]
    print(f"\n| | full | {label} | ratio |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(map(str, row)) + " |")
    if args.json:
        args.json.write_text(json.dumps({
            "preset": args.preset, "dataset": dataset, "method": method, "budget": args.budget, "n": args.n,
            "load_average": os.getloadavg(), "summaries": summaries, "predicted_admission": predicted, "gain": gain,
            "admitted": m / n,
            "ceiling": ceil.ratio, "decode_ceiling": ceil.decode_ratio, "gain_over_ceiling": gain / ceil.ratio,
            "hf": {str(b.batch): {"tok_s": b.tok_s, "decode_tok_s": b.decode_tok_s, "seconds": b.seconds,
                                   "prefill_s": b.prefill_s, "prompt_len": b.prompt_len, "new_tokens": b.new_tokens}
                   for b in (ceil.n, ceil.m)}}, indent=1, default=str))


if __name__ == "__main__":
    main()
