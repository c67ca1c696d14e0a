"""lm-eval results (`python -m kvbench.harness ... --output_path OUT --log_samples`) as kvbench run directories, so
the report rebuilds few-shot tables (Keyformer Table 2) from them like any other run.

    python -m kvbench.report.lm_eval_runs OUT --out results    # then: python -m kvbench.report results --paper ...

One run directory per lm-eval evaluation and shot count, `<out>/lm_eval/<model>/<method>/<budget>-<n>shot-<hash>`:
manifest.json (method: its table name as a kvbench run's, `tailorkv-1` or `snapkv+per_layer`; budget, ratio, the
model's name from configs/model/, dataset `lm_eval`, primary metric `acc`, and `method_prepared`: what the method's
`prepare` returned, as a kvbench run records it), config.yaml (the method's `method.<field>` arguments, positions,
num_fewshot) and one record per document (`id` = task-doc_id, `scores` = lm-eval's per-document metrics,
`meta.task`, `meta.num_fewshot`), so the mean of a task's records is lm-eval's own score for it.
"""
from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import yaml

from kvbench.report.paper import CONFIGS

METRICS = ("acc", "acc_norm", "exact_match")


def model_name(args: dict) -> str:
    """kvbench's name of the model an lm-eval run used (configs/model/<model>.yaml, or the path of model=hf)."""
    config = CONFIGS / "model" / f"{args.get('model', 'smollm2')}.yaml"
    if args.get("model") == "hf" or not config.is_file():
        return str(args.get("path") or args.get("model"))
    return yaml.safe_load(config.read_text(encoding="utf-8"))["name"]


def import_results(results_file: Path, out: Path) -> list[Path]:
    """The run directories written for one lm-eval results_<time>.json (its samples_<task>_<time>.jsonl beside)."""
    results = json.loads(results_file.read_text(encoding="utf-8"))
    info = results["config"]  # lm-eval's run config, with what the kvbench model added (KVBenchLM.get_model_info)
    args = dict(info["model_args"])
    stamp = results_file.stem.removeprefix("results_")
    method = str(info.get("method_label") or args.get("method", "full"))  # a run's table name (snapkv+per_layer)
    by_shots: dict[int, list[dict]] = {}
    for task in results["results"]:
        samples = results_file.with_name(f"samples_{task}_{stamp}.jsonl")
        if task not in results.get("n-shot", {}) or not samples.is_file():
            continue  # a group's aggregate, or a run without --log_samples: no per-document records
        shots = int(results["n-shot"][task])
        for line in samples.read_text(encoding="utf-8").splitlines():
            doc = json.loads(line)
            scores = {m: float(doc[m]) for m in METRICS if m in doc}
            by_shots.setdefault(shots, []).append(
                {"id": f"{task}-{doc['doc_id']}", "score": next(iter(scores.values()), None), "scores": scores,
                 "meta": {"task": task, "num_fewshot": shots}, "prediction": "", "references": []})
    written = []
    for shots, records in sorted(by_shots.items()):
        budget, ratio = args.get("budget"), args.get("ratio")
        key = json.dumps({**args, "num_fewshot": shots}, sort_keys=True, default=str)
        label = f"b{budget}" if budget is not None else f"r{ratio}" if ratio is not None else "bNone"
        run = (out / "lm_eval" / model_name(args) / method
               / f"{label}-{shots}shot-{hashlib.sha256(key.encode()).hexdigest()[:8]}")
        run.mkdir(parents=True, exist_ok=True)
        manifest = {"method": method, "budget": None if budget is None else int(budget),
                    "ratio": None if ratio is None else float(ratio), "model": model_name(args),
                    "dataset": "lm_eval", "dataset_version": results.get("lm_eval_version"),
                    "primary_metric": "acc", "n_samples": len(records), "source": str(results_file),
                    **({"method_prepared": info["method_prepared"]} if "method_prepared" in info else {})}
        config = {"method": {k.removeprefix("method."): v for k, v in args.items() if k.startswith("method.")},
                  "positions": args.get("positions", "original"), "num_fewshot": shots}
        (run / "manifest.json").write_text(json.dumps(manifest, indent=1), encoding="utf-8")
        (run / "config.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
        (run / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
        written.append(run)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvbench.report.lm_eval_runs", description=__doc__.split("\n")[0])
    parser.add_argument("lm_eval_output", type=Path, help="lm-eval's --output_path (searched for results_*.json)")
    parser.add_argument("--out", type=Path, default=Path("results"), help="results root for the run directories")
    ns = parser.parse_args(argv)
    files = sorted(ns.lm_eval_output.rglob("results_*.json"))
    if not files:
        parser.error(f"no lm-eval results_*.json under {ns.lm_eval_output}")
    for f in files:
        for run in import_results(f, ns.out):
            print(run)


if __name__ == "__main__":
    main()
