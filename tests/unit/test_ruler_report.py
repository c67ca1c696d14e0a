"""The RULER report: per-task table with RULER's average, the long summary, and the two figures."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from kvbench.report import ruler as report


def records(method: str, budget: int | None, length: int, hits: dict[str, list[bool]]) -> list[dict]:
    rows = []
    for task, outcome in hits.items():
        for i, hit in enumerate(outcome):
            rows.append({"model": "m", "dataset": "ruler", "dataset_version": "2024-12.1", "method": method,
                         "budget": budget, "ratio": None, "id": f"{task}-{length}-{i}", "meta.task": task,
                         "meta.length": length, "references": ["1234567"],
                         "prediction": " 1234567" if hit else "", "score": float(hit)})
    return rows


@pytest.fixture
def df() -> pd.DataFrame:
    rows = []
    for length in (4096, 8192):
        for budget in (128, 512):  # a full-cache sweep over budgets: the same records twice
            rows += records("full", budget, length, {"niah_single_1": [True, True], "vt": [True, False]})
        rows += records("snapkv", 128, length, {"niah_single_1": [True, False], "vt": [False, False]})
        rows += records("snapkv", 512, length, {"niah_single_1": [True, True], "vt": [True, False]})
    frame = pd.DataFrame(rows)
    frame["budget"] = frame["budget"].astype("Int64")
    frame["ratio"] = frame["ratio"].astype("Float64")
    return frame


def test_table_has_one_row_per_configuration_and_rulers_average(df):
    wide = report.wide_table(report.task_scores(df))
    assert list(wide.columns) == ["model", "method", "budget", "length", "niah_single_1", "vt", "Avg."]
    assert [(r.method, None if pd.isna(r.budget) else int(r.budget), int(r.length)) for r in wide.itertuples()] == [
        ("full", None, 4096), ("snapkv", 128, 4096), ("snapkv", 512, 4096),
        ("full", None, 8192), ("snapkv", 128, 8192), ("snapkv", 512, 8192)]
    full = wide.iloc[0]
    assert (full["niah_single_1"], full["vt"], full["Avg."]) == (100.0, 50.0, 75.0)   # duplicates counted once
    assert tuple(wide.iloc[1][["niah_single_1", "vt", "Avg."]]) == (50.0, 0.0, 25.0)


def test_write_reports_files(df, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "scores.json").write_text(json.dumps({"ruler": {"skipped": {"qa_1": "no SQuAD v2.0 dev file"}}}))
    df["run_dir"] = str(run_dir)
    paths = report.write_reports(df, tmp_path)
    names = sorted(p.name for p in paths)
    assert names == ["ruler_summary.csv", "ruler_table.csv", "ruler_table.md", "ruler_table.tex",
                     "ruler_vs_budget.png", "ruler_vs_length.png"]
    md = (tmp_path / "ruler_table.md").read_text()
    assert "| Model | Method | KV Size | Length | niah_single_1 | vt | Avg. |" in md
    assert "| m | FullKV | – | 4096 | 100.00 | 50.00 | 75.00 |" in md and "| m | SnapKV | 128 | 8192 |" in md
    assert "covers 2 of 13 tasks" in md and "Skipped qa_1: no SQuAD v2.0 dev file." in md
    assert r"niah\_single\_1" in (tmp_path / "ruler_table.tex").read_text()
    summary = pd.read_csv(tmp_path / "ruler_summary.csv")
    assert set(summary.columns) >= {"task", "score", "nulls", "n"} and len(summary) == 12
    assert all((tmp_path / n).stat().st_size > 10_000 for n in ("ruler_vs_budget.png", "ruler_vs_length.png"))


def test_no_ruler_records_no_reports(tmp_path):
    assert report.write_reports(pd.DataFrame({"dataset": ["niah"], "meta.context_length": [1000]}), tmp_path) == []
