"""LongBench tables and figure from run directories, and the whole path through the CLI (tiny model; the embedded
SmolLM2 in a slow test): predictions, scores.json, resume, then `python -m kvbench.report` writes the table."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from kvbench.report import load_runs
from kvbench.report.longbench import kv_size, run_rows, table_frame, to_latex, to_markdown, write_reports
from kvbench.report.__main__ import main as report_main
from tests.unit.test_cli import refusal, run_here

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "longbench"


def make_run(root: Path, method: str, budget: int | None, scores: dict[str, list[float]], dataset="longbench",
             model="smollm2", lengths: dict[str, list[int]] | None = None, tag="abcd1234") -> Path:
    run = root / dataset / model / method / f"b{budget}-{tag}"
    run.mkdir(parents=True)
    manifest = {"method": method, "budget": budget, "ratio": None, "model": model, "dataset": dataset,
                "dataset_version": "1", "primary_metric": "longbench"}
    (run / "manifest.json").write_text(json.dumps(manifest))
    lines = []
    for task, values in scores.items():
        for i, s in enumerate(values):
            length = (lengths or {}).get(task, [0] * len(values))[i]
            lines.append(json.dumps({"id": f"{task}-{i}", "score": s, "scores": {"longbench": s},
                                     "meta": {"task": task, "index": i, "length": length}}))
    (run / "predictions.jsonl").write_text("\n".join(lines) + "\n")
    return run


@pytest.fixture
def runs(tmp_path) -> Path:
    make_run(tmp_path, "full", 128, {"qasper": [1.0, 0.5], "trec": [1.0, 1.0], "lcc": [0.8, 0.6]})
    make_run(tmp_path, "snapkv", 64, {"qasper": [0.5, 0.5], "trec": [1.0, 0.0], "lcc": [0.7, 0.6]})
    make_run(tmp_path, "pyramidkv", 64, {"qasper": [1.0, 0.0], "trec": [1.0, 0.5], "lcc": [0.4, 0.6]})
    make_run(tmp_path, "snapkv", 128, {"qasper": [1.0, 0.5], "trec": [1.0, 1.0], "lcc": [0.8, 0.5]})
    make_run(tmp_path, "streamingllm", 128, {"qasper": [0.0, 0.5], "trec": [1.0]})   # lcc missing: no Avg.
    return tmp_path


def test_table_layout_rows_columns_and_avg(runs):
    frame = table_frame(run_rows(load_runs([runs])))
    assert frame.attrs["tasks"] == ["qasper", "trec", "lcc"]          # category order: single-doc, few-shot, code
    assert [(r["method"], kv_size(r)) for _, r in frame.iterrows()] == [
        ("full", "Full"), ("pyramidkv", "64"), ("snapkv", "64"), ("snapkv", "128"), ("streamingllm", "128")]
    full = frame.iloc[0]
    assert (full["qasper"], full["trec"], full["lcc"], full["Avg."]) == (75.0, 100.0, 70.0, 81.67)
    assert pd.isna(frame.iloc[4]["Avg."]) and frame.iloc[4]["trec"] == 100.0
    assert frame.iloc[1]["en:Few-shot Learning"] == 75.0


def test_markdown_is_the_papers_layout(runs):
    md = to_markdown(table_frame(run_rows(load_runs([runs]))))
    lines = md.splitlines()
    assert lines[0] == "Columns by category: Single-Doc. QA: Qasper · Few-shot Learning: TREC · Code: Lcc."
    assert lines[2:] == [
        "| KV Size | Method | Qasper | TREC | Lcc | Avg. |",
        "|:---|:---|---:|---:|---:|---:|",
        "| Full | FullKV | 75.00 | 100.00 | 70.00 | 81.67 |",
        "| 64 | PyramidKV | 50.00 | **75.00** | 50.00 | **58.33** |",
        "| 64 | SnapKV | 50.00 | 50.00 | **65.00** | 55.00 |",
        "| 128 | SnapKV | **75.00** | 100.00 | 65.00 | 80.00 |",
        "| 128 | StreamingLLM | 25.00 | 100.00 | – | – |",
    ]   # best compressed value per KV size in bold; not where all rows tie or only one row has a value


def test_latex_has_category_spans_and_budget_blocks(runs):
    tex = to_latex(table_frame(run_rows(load_runs([runs]))))
    assert r"\multicolumn{1}{c}{Single-Doc. QA} & \multicolumn{1}{c}{Few-shot Learning}" in tex
    assert r"\cmidrule(lr){3-3} \cmidrule(lr){4-4} \cmidrule(lr){5-5}" in tex
    assert r"64 & PyramidKV & 50.00 & \textbf{75.00} & 50.00 & \textbf{58.33} \\" in tex
    assert tex.count(r"\midrule") == 3            # after the header, before KV 64, before KV 128


def test_write_reports_files_csv_and_figure(runs, tmp_path):
    out = tmp_path / "report"
    paths = write_reports(load_runs([runs]), out)
    assert [p.name for p in paths] == ["longbench_table.md", "longbench_table.tex", "longbench_table.csv",
                                       "longbench_budget.png"]
    csv = pd.read_csv(out / "longbench_table.csv")
    assert list(csv.columns[:9]) == ["model", "dataset", "method", "budget", "ratio", "qasper", "trec", "lcc", "Avg."]
    assert "LongBench aggregation (English" in (out / "longbench_table.md").read_text()
    assert (out / "longbench_budget.png").stat().st_size > 10_000


def test_longbench_e_table(tmp_path):
    make_run(tmp_path, "snapkv", 64, {"qasper_e": [1.0, 0.5, 0.0], "trec_e": [1.0, 0.0]}, dataset="longbench_e",
             lengths={"qasper_e": [100, 5000, 9000], "trec_e": [3999, 4000]})
    paths = write_reports(load_runs([tmp_path]), tmp_path / "report")
    assert [p.name for p in paths] == ["longbench_e_table.md", "longbench_e_table.csv"]
    md = (tmp_path / "report" / "longbench_e_table.md").read_text().splitlines()
    assert md[-1] == "| 64 | SnapKV | 100.00 | 25.00 | 0.00 |"
    csv = pd.read_csv(tmp_path / "report" / "longbench_e_table.csv")
    assert csv.loc[0, "trec_e:4-8k"] == 0.0 and pd.isna(csv.loc[0, "trec_e:8k+"])


def test_duplicate_ids_across_runs_keep_the_last(tmp_path, caplog):
    make_run(tmp_path, "snapkv", 64, {"trec": [0.0]}, tag="aaaa0000")
    make_run(tmp_path, "snapkv", 64, {"trec": [1.0]}, tag="bbbb1111")
    frame = table_frame(run_rows(load_runs([tmp_path])))
    assert len(frame) == 1 and frame.iloc[0]["trec"] == 100.0
    assert "duplicate ids" in caplog.text


def test_no_longbench_records_writes_nothing(tmp_path):
    assert write_reports(pd.DataFrame({"dataset": ["niah"], "score": [1.0]}), tmp_path) == []


# --- end to end as the CLI runs it ----------------------------------------------------------------------------------
def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]


def test_cli_tiny_model_runs_resumes_and_reports(tmp_path, capfd):
    """`python -m kvbench.run -m method=full,snapkv ... dataset=longbench` with limit=2, then again without it, then
    `python -m kvbench.report`: each job as the command runs it, in this process (run_here, report's main; the
    command line as a process: test_cli.py, test_grid.py)."""
    args = ["model=tiny_llama", "budget=40", "dataset=longbench", f"dataset.root={FIXTURES}",
            "dataset.tasks=[trec,lcc]"]
    run_dirs = [run_here(f"method={m}", *args, "limit=2", results=tmp_path) for m in ("full", "snapkv")]
    assert sorted(p.parent for p in tmp_path.rglob("predictions.jsonl")) == run_dirs
    assert [d.relative_to(tmp_path).parts[:3] for d in run_dirs] == [("longbench", "tiny-llama", "full"),
                                                                     ("longbench", "tiny-llama", "snapkv")]
    assert all([r["id"] for r in records(d)] == ["trec-kvb-trc-001", "trec-kvb-trc-002"] for d in run_dirs)

    before = {d: records(d) for d in run_dirs}
    capfd.readouterr()
    again = [run_here(f"method={m}", *args, results=tmp_path) for m in ("full", "snapkv")]  # the two lcc samples added
    assert again == run_dirs                                  # same run directories
    assert capfd.readouterr().err.count("| 2/4 [") == 2       # each progress bar starts at the finished samples
    for d in run_dirs:
        recs = records(d)
        assert recs[:2] == before[d]                          # finished work is kept, not recomputed
        assert [r["id"] for r in recs] == ["trec-kvb-trc-001", "trec-kvb-trc-002", "lcc-kvb-lcc-001",
                                           "lcc-kvb-lcc-002"]
        assert [r["new_tokens"] <= 64 for r in recs] and all(0 <= r["score"] <= 1 for r in recs)
        assert recs[0]["meta"]["all_classes"][0] == "Location" and recs[2]["meta"]["task"] == "lcc"
        scores = json.loads((d / "scores.json").read_text())
        assert scores["n"] == 4 and set(scores["longbench"]["tasks"]) == {"trec", "lcc"}
        assert scores["longbench"]["protocol"] == "longbench"
        assert scores["longbench"]["avg"] == round(sum(scores["longbench"]["tasks"].values()) / 2, 2)
    snap = records(run_dirs[1])
    assert snap[0]["kept_per_layer"] == [40.0, 40.0] and snap[0]["kv_bytes"] < snap[0]["full_kv_bytes"]

    assert report_main([str(tmp_path), "--out", str(tmp_path / "rep")]) == 0
    md = (tmp_path / "rep" / "longbench_table.md").read_text()
    assert "| KV Size | Method | TREC | Lcc | Avg. |" in md and "| Full | FullKV |" in md and "| 40 | SnapKV |" in md
    assert (tmp_path / "rep" / "longbench_table.tex").is_file() and (tmp_path / "rep" / "longbench_budget.png")


def test_cli_missing_data_folder_is_one_clear_line(tmp_path):
    line = refusal("model=tiny_llama", "dataset=longbench", f"dataset.root={tmp_path / 'none'}", results=tmp_path)
    assert "longbench: no folder" in line and "scripts/download_longbench.py" in line


@pytest.mark.slow
def test_cli_embedded_model_two_fixture_records(tmp_path):
    """SmolLM2-135M on one trec and one passage_retrieval_en record, full cache and SnapKV at 64 (16 new tokens at
    most: trec's own 64 were most of the test's time)."""
    args = ["budget=64", "dataset=longbench", f"dataset.root={FIXTURES}", "dataset.tasks=[trec,passage_retrieval_en]",
            "dataset.limit_per_task=1", "dataset.max_new_tokens=16"]
    run_dirs = [run_here(f"method={m}", *args, results=tmp_path) for m in ("full", "snapkv")]  # in this process
    assert sorted(p.parent for p in tmp_path.rglob("predictions.jsonl")) == run_dirs
    for d in run_dirs:
        recs = records(d)
        assert [r["id"] for r in recs] == ["trec-kvb-trc-001", "passage_retrieval_en-kvb-pre-001"]
        assert all(r["prediction"] and r["new_tokens"] > 0 for r in recs)
        scores = json.loads((d / "scores.json").read_text())["longbench"]
        assert set(scores["tasks"]) == {"trec", "passage_retrieval_en"}
    before = [records(d) for d in run_dirs]
    assert [run_here(f"method={m}", *args, results=tmp_path) for m in ("full", "snapkv")] == run_dirs
    assert [records(d) for d in run_dirs] == before           # nothing recomputed, nothing duplicated
    assert write_reports(load_runs([tmp_path]), tmp_path / "rep")[0].name == "longbench_table.md"
