"""RULER end to end through the command line: all 13 tasks on the tiny random model (one sample each, 1K tokens),
then the report; and one slow run on the embedded SmolLM2."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbench.data.ruler.templates import ALL_TASKS
from kvbench.report.__main__ import main as report_main
from tests.unit.test_cli import refusal, run_here

ROOT = Path(__file__).resolve().parents[2]
QA_ROOT = ROOT / "tests" / "fixtures" / "ruler" / "qa"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1"}


def kvbench(*args: str, results: Path, module: str = "kvbench.run") -> subprocess.CompletedProcess:
    extra = [f"results_dir={results}"] if module == "kvbench.run" else []
    return subprocess.run([sys.executable, "-m", module, *args, *extra], cwd=ROOT, env=ENV, capture_output=True,
                          text=True)


def ruler_args(tmp_path: Path, length: int = 1024) -> list[str]:
    return ["dataset=ruler", f"dataset.length={length}", "dataset.num_samples=1", f"dataset.qa_root={QA_ROOT}",
            f"dataset.cache_dir={tmp_path / 'cache'}"]


def only_run_dir(results: Path) -> Path:
    (run_dir,) = [p.parent for p in results.rglob("predictions.jsonl")]
    return run_dir


def test_all_tasks_run_score_and_report_on_the_tiny_model(tmp_path):
    run_dir = run_here("model=tiny_llama", "method=snapkv", "budget=64", *ruler_args(tmp_path),
                       results=tmp_path / "res")
    assert only_run_dir(tmp_path / "res") == run_dir
    assert run_dir.relative_to(tmp_path / "res").parts[:3] == ("ruler", "tiny-llama", "snapkv")
    recs = [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]
    assert [r["id"] for r in recs] == [f"{t}-1024-0" for t in ALL_TASKS]
    assert all(r["prompt_tokens"] <= 1024 and r["effective_budget"] == 64.0 for r in recs)
    assert {r["meta"]["task"]: r["new_tokens"] <= 128 for r in recs} == {t: True for t in ALL_TASKS}
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["dataset"] == "ruler" and manifest["dataset_version"] == "2024-12.1"
    summary = json.loads((run_dir / "scores.json").read_text())["ruler"]
    assert summary["code"] == "NVIDIA/RULER@c5341b4" and list(summary["lengths"]["1024"]["tasks"]) == ALL_TASKS

    assert report_main([str(tmp_path / "res"), "--out", str(tmp_path / "report")]) == 0
    table = (tmp_path / "report" / "ruler_table.md").read_text()
    assert "| tiny-llama | SnapKV | 64 | 1024 |" in table and "qa_2 | Avg. |" in table
    assert (tmp_path / "report" / "ruler_vs_length.png").is_file()


def test_bad_ruler_config_gets_one_line_error(tmp_path):
    line = refusal("model=tiny_llama", "dataset=ruler", "dataset.tasks=[niah_single_4]", results=tmp_path / "res")
    assert "Unknown task 'niah_single_4'" in line, line


@pytest.mark.slow
def test_embedded_model_full_cache_at_1k(tmp_path):
    """The embedded SmolLM2 with a full cache at 1K tokens, one sample of four task families (the whole set takes
    minutes on 2 cores): runs, scores, and retrieves the noise-haystack needle, the easiest task. 16 new tokens at
    most (the needle's 7 digits fit; fwe's own 50 and vt's 30 were a third of the test's time)."""
    tasks = ["niah_single_1", "vt", "fwe", "qa_2"]
    run_dir = run_here("method=full", *ruler_args(tmp_path), f"dataset.tasks=[{','.join(tasks)}]",
                       "dataset.max_new_tokens=16", results=tmp_path / "res")
    summary = json.loads((run_dir / "scores.json").read_text())["ruler"]
    scores = summary["lengths"]["1024"]["tasks"]
    assert list(scores) == tasks and scores["niah_single_1"]["score"] == 100.0
