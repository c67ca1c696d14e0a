"""kvbench.report.lm_eval_runs writes the manifests a kvbench run writes: `method_prepared` (what the method's
`prepare` returned, in lm-eval's results as `config.method_prepared`: KVBenchLM.get_model_info) and the method's
table name (`config.method_label`: `tailorkv-1`, `snapkv+per_layer`). Before, both were dropped: an imported TailorKV
run had no layer split and a wrapped method's run was named, and averaged in the tables, as the plain method."""
from __future__ import annotations

import json
from pathlib import Path

from kvbench.report.lm_eval_runs import import_results

PREPARED = {"quant_layers": [0], "identification": {"scores": [0.5, 0.25], "prompt_tokens": 96}}


def lm_eval_results(root: Path, model_args: dict, **model_info) -> Path:
    """One task's results_<time>.json and samples file as lm-eval writes them, `model_info` in its config as
    lm-eval's evaluator adds it (`results["config"].update(lm.get_model_info())`)."""
    root.mkdir(parents=True)
    stamp = "2026-01-01T00-00-00.000000"
    results = root / f"results_{stamp}.json"
    results.write_text(json.dumps({"results": {"copa": {"acc,none": 0.5}}, "n-shot": {"copa": 0},
                                   "config": {"model": "kvbench", "model_args": model_args, **model_info}}))
    (root / f"samples_copa_{stamp}.jsonl").write_text('{"doc_id": 0, "acc": 1.0}\n{"doc_id": 1, "acc": 0.0}\n')
    return results


def manifest(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())


def test_method_prepared_and_table_name_reach_the_manifest(tmp_path):
    results = lm_eval_results(tmp_path / "o1", {"model": "tiny_llama", "method": "tailorkv", "budget": 80},
                              method_prepared=PREPARED, method_label="tailorkv-1")
    (run,) = import_results(results, tmp_path / "runs")
    assert run.parts[-2] == "tailorkv-1"
    assert {k: manifest(run)[k] for k in ("method", "method_prepared", "budget")} == {
        "method": "tailorkv-1", "method_prepared": PREPARED, "budget": 80}


def test_a_method_without_either_is_named_by_its_argument(tmp_path):
    (run,) = import_results(lm_eval_results(tmp_path / "o2", {"model": "tiny_llama", "method": "h2o", "budget": 8}),
                            tmp_path / "runs")
    assert manifest(run)["method"] == "h2o" and "method_prepared" not in manifest(run)
