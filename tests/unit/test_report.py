"""kvbench.report on hand-written run directories: loading, table arithmetic, heatmap colours, CLI."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib.image import imread

from kvbench.report import (load_runs, needle_heatmap, needle_matrix, needle_panels, summary_table, to_latex,
                            to_markdown, write_run_report, write_tables)
from kvbench.report.__main__ import main as report_main
from kvbench.report.heatmap import CMAP
from kvbench.report.runs import read_manifest

REPO = Path(__file__).resolve().parents[2]
LENGTHS, DEPTHS = [1000, 2000, 3000], [0.0, 50.0, 100.0]


def record(i: int, score: float, **kw) -> dict:
    """A predictions.jsonl record with every docs/records.md field; costs derived from i so means are easy to check."""
    rec = {"id": f"s{i}", "prompt_sha256": "0" * 64, "prompt_tokens": 1000, "prediction": "x", "references": ["x"],
           "score": score, "scores": {"pyramidkv_recall": score, "rouge1": score / 2}, "meta": {}, "new_tokens": 5,
           "kept_per_layer": [64, 64], "kept_per_head": [[64, 64], [64, 64]], "kv_bytes": 100 * (i + 1),
           "full_kv_bytes": 1000, "kv_bytes_final": 120, "effective_budget": 60.0 + i, "prefill_s": 0.5 * (i + 1),
           "compress_s": 0.01, "decode_s": 0.2, "decode_tok_s": 10.0 * (i + 1), "peak_mem_bytes": 1 << 20}
    rec.update(kw)
    return rec


def niah_records(scores: dict[tuple[int, float], float]) -> list[dict]:
    cells = enumerate(scores.items())
    return [record(i, s, meta={"context_length": n, "depth_percent": d}) for i, ((n, d), s) in cells]


def make_run(root: Path, method: str, budget: int | None, records: list[dict], dataset: str = "niah",
             model: str = "smollm2-135m", primary: str = "pyramidkv_recall", tail: str = "") -> Path:
    run = root / dataset / model / method / f"b{budget}-abcd1234"
    run.mkdir(parents=True)
    manifest = {"kvbench_version": "0.1.0", "git_sha": None, "method": method, "budget": budget, "ratio": None,
                "model": model, "model_source": "embedded", "dataset": dataset, "dataset_version": "1",
                "primary_metric": primary, "n_samples": len(records)}
    (run / "manifest.json").write_text(json.dumps(manifest))
    (run / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return run


@pytest.fixture
def three_runs(tmp_path: Path) -> Path:
    root = tmp_path / "results"
    make_run(root, "snapkv", 128, [record(i, s) for i, s in enumerate([1.0, 0.0, 1.0, 0.5])])
    make_run(root, "full", None, [record(i, 1.0) for i in range(4)])
    make_run(root, "pyramidkv", 64, [record(i, s) for i, s in enumerate([0.25, 0.75])])
    return root


# --- loading ---------------------------------------------------------------------------------------------------

def test_load_runs_finds_nested_runs_and_adds_manifest(three_runs: Path):
    df = load_runs([three_runs])
    assert len(df) == 10
    assert {"method", "budget", "model", "dataset", "run_dir", "scores.rouge1"} <= set(df.columns)
    assert sorted(df["method"].unique()) == ["full", "pyramidkv", "snapkv"]
    assert df.loc[df["method"] == "full", "budget"].isna().all()
    one = load_runs([next((three_runs / "niah").rglob("predictions.jsonl")).parent])
    assert one["run_dir"].nunique() == 1


def test_torn_last_line_is_skipped(tmp_path: Path):
    run = make_run(tmp_path, "snapkv", 128, [record(i, 1.0) for i in range(3)], tail='{"id": "s3", "pred')
    assert list(load_runs([run])["id"]) == ["s0", "s1", "s2"]


def test_corrupt_middle_line_raises_with_line_number(tmp_path: Path):
    run = make_run(tmp_path, "snapkv", 128, [record(0, 1.0)], tail='{"id": "s1", "pred\n' + json.dumps(record(2, 1.0)))
    with pytest.raises(ValueError, match=r"predictions.jsonl:2"):
        load_runs([run])


def test_no_run_directory_is_a_one_line_error(tmp_path: Path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no run directory") as e:
        load_runs([tmp_path / "empty"])
    assert str(tmp_path / "empty") in str(e.value) and "\n" not in str(e.value)


# --- tables ----------------------------------------------------------------------------------------------------

def test_summary_table_matches_hand_computed_means(three_runs: Path):
    t = summary_table(load_runs([three_runs]))
    assert list(t["method"]) == ["full", "pyramidkv", "snapkv"]            # full first, then by budget
    assert list(t.columns) == ["model", "dataset", "method", "budget", "n", "Acc.", "se", "effective_budget",
                               "kv_bytes_frac", "bits", "bytes_per_entry", "prefill_s", "decode_tok_s"]
    snap = t[t["method"] == "snapkv"].iloc[0]
    assert snap["n"] == 4 and snap["budget"] == 128
    assert snap["Acc."] == pytest.approx(100 * (1.0 + 0.0 + 1.0 + 0.5) / 4)
    # squared deviations from .625: .140625 .390625 .140625 .015625 -> sd^2 = .6875 / 3; se = sd / 2, x 100
    assert snap["se"] == pytest.approx(100 * (0.6875 / 3) ** 0.5 / 2)
    assert snap["effective_budget"] == pytest.approx((60 + 61 + 62 + 63) / 4)
    assert snap["kv_bytes_frac"] == pytest.approx((100 + 200 + 300 + 400) / 4000)
    assert snap["prefill_s"] == pytest.approx((0.5 + 1.0 + 1.5 + 2.0) / 4)
    assert snap["decode_tok_s"] == pytest.approx(25.0)
    pyr = t[t["method"] == "pyramidkv"].iloc[0]
    assert pyr["Acc."] == pytest.approx(50.0) and pyr["kv_bytes_frac"] == pytest.approx(300 / 2000)


def test_scores_outside_unit_interval_stay_native(tmp_path: Path):
    make_run(tmp_path, "snapkv", 128, [record(0, 7.5), record(1, 2.5)], dataset="x", primary="rouge_x10")
    t = summary_table(load_runs([tmp_path]))
    assert list(t.columns)[5] == "rouge_x10" and t.iloc[0]["rouge_x10"] == pytest.approx(5.0)


def test_writers(three_runs: Path, tmp_path: Path):
    t = summary_table(load_runs([three_runs]))
    md = to_markdown(t)
    assert "| Acc. |" in md and "| FullKV |" in md and "| 62.50 |" in md
    assert md.splitlines()[3].startswith("| smollm2-135m | niah | PyramidKV | 64 | 2 | 50.00 |")
    tex = to_latex(t.assign(dataset="niah_single"))
    assert r"\toprule" in tex and r"niah\_single" in tex and tex.count(r"\\") == 4
    paths = write_tables(t, tmp_path / "out")
    assert [p.name for p in paths] == ["table.md", "table.tex", "table.csv"]
    back = pd.read_csv(paths[2])
    assert back["Acc."].tolist() == pytest.approx(t["Acc."].tolist())


# --- heatmaps --------------------------------------------------------------------------------------------------

GRID = {(n, d): 0.5 for n in LENGTHS for d in DEPTHS}
GRID.update({(1000, 0.0): 1.0, (3000, 100.0): 0.0})
del GRID[(2000, 50.0)]                                                  # a missing cell


def test_needle_matrix_layout(tmp_path: Path):
    df = load_runs([make_run(tmp_path, "snapkv", 128, niah_records(GRID))])
    m = needle_matrix(df)
    assert list(m.index) == DEPTHS and list(m.columns) == LENGTHS          # depth 0 first (top), lengths ascending
    assert m.loc[0.0, 1000] == 1.0 and m.loc[100.0, 3000] == 0.0 and np.isnan(m.loc[50.0, 2000])


def _pixel(img: np.ndarray, ax, row: int, col: int, n_rows: int, n_cols: int) -> np.ndarray:
    """RGB at the centre of heatmap cell (row, col), row 0 at the top; axes position is in figure fractions."""
    box = ax.get_position()
    h, w = img.shape[:2]
    x = (box.x0 + (col + 0.5) / n_cols * box.width) * w
    y = (1 - (box.y1 - (row + 0.5) / n_rows * box.height)) * h
    return img[int(y), int(x), :3]


def test_heatmap_colours_follow_colormap(tmp_path: Path):
    df = load_runs([make_run(tmp_path, "snapkv", 128, niah_records(GRID))])
    fig = needle_heatmap(df, tmp_path / "heatmap.png")
    img = imread(tmp_path / "heatmap.png")
    ax = fig.axes[0]
    green, red = np.array(CMAP(1.0)[:3]), np.array(CMAP(0.0)[:3])
    assert np.allclose(green, [0x0C / 255, 0xD7 / 255, 0x9F / 255], atol=0.01)
    assert np.allclose(_pixel(img, ax, 0, 0, 3, 3), green, atol=0.02)     # depth 0, length 1000: score 1
    assert np.allclose(_pixel(img, ax, 2, 2, 3, 3), red, atol=0.02)       # depth 100, length 3000: score 0
    assert np.allclose(_pixel(img, ax, 1, 1, 3, 3), [1, 1, 1], atol=0.02)  # missing cell left blank
    assert ax.get_xlabel() == "Token Limit" and ax.get_ylabel() == "Depth Percent"
    assert ax.get_title().startswith("Pressure Testing smollm2-135m \nFact Retrieval Across Context Lengths")
    scores = df["score"].to_numpy(dtype=float)
    se = 100 * scores.std(ddof=1) / len(scores) ** 0.5
    assert ax.get_title().endswith(f"SnapKV, KV Size=128, acc 50.0 ± {se:.1f} (n={len(scores)})")
    assert fig.axes[1].get_ylabel() == "Score"


def test_needle_panels_order_and_captions(tmp_path: Path):
    make_run(tmp_path, "snapkv", 64, niah_records({k: 0.0 for k in GRID}))
    make_run(tmp_path, "full", None, niah_records({k: 1.0 for k in GRID}))
    make_run(tmp_path, "pyramidkv", 64, niah_records(GRID))
    fig = needle_panels(load_runs([tmp_path]), tmp_path / "panels.pdf")
    titles = [ax.get_title() for ax in fig.axes[:3]]
    assert titles == ["(a) FullKV, acc 100.0", "(b) PyramidKV, KV Size=64, acc 50.0", "(c) SnapKV, KV Size=64, acc 0.0"]
    assert fig.get_suptitle() == "smollm2-135m - 3K Context Size"
    assert (tmp_path / "panels.pdf").read_bytes()[:4] == b"%PDF"


def test_write_run_report(tmp_path: Path):
    niah = make_run(tmp_path / "a", "snapkv", 128, niah_records(GRID))
    plain = make_run(tmp_path / "b", "snapkv", 128, [record(0, 1.0)], dataset="qa", primary="qa_f1")
    write_run_report(niah)
    write_run_report(plain)
    assert imread(niah / "heatmap.png").shape[2] in (3, 4)
    assert "| Acc. |" in (niah / "summary.md").read_text() and "| rouge1 |" in (niah / "summary.md").read_text()
    assert (plain / "summary.md").is_file() and not (plain / "heatmap.png").exists()


# --- CLI -------------------------------------------------------------------------------------------------------

def _cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "kvbench.report", *args], cwd=cwd, env=env, capture_output=True,
                          text=True)


def test_cli_writes_tables_and_panels(tmp_path: Path):
    make_run(tmp_path / "results", "full", None, niah_records({k: 1.0 for k in GRID}))
    make_run(tmp_path / "results", "snapkv", 64, niah_records(GRID))
    out = tmp_path / "report"
    proc = _cli(str(tmp_path / "results"), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "| FullKV |" in proc.stdout and "| SnapKV |" in proc.stdout
    for name in ("table.md", "table.tex", "table.csv", "needle_panels.png"):
        assert (out / name).is_file(), name


def test_cli_reports_missing_runs(tmp_path: Path):
    proc = _cli(str(tmp_path))
    assert proc.returncode == 1 and proc.stderr == (f"kvbench: report: no run directory (a folder with "
                                                    f"predictions.jsonl) found under {tmp_path}\n")


def test_cli_writes_beside_the_runs_by_default(tmp_path: Path):
    """Without --out, from another directory: the files go to <the folder given>/report, none to the current
    directory, and the last line says so."""
    make_run(tmp_path / "results", "snapkv", 64, [record(0, 1.0)], dataset="qa", primary="qa_f1")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = _cli("../results", cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "results" / "report").iterdir()) == ["table.csv", "table.md", "table.tex"]
    assert list(elsewhere.iterdir()) == []
    assert proc.stderr.splitlines()[-1] == f"report: wrote 3 files to {tmp_path / 'results' / 'report'}"


def test_default_out_is_the_common_folder_of_the_paths(tmp_path: Path, monkeypatch, capsys):
    a = make_run(tmp_path / "results", "snapkv", 64, [record(0, 1.0)], dataset="qa", primary="qa_f1")
    b = make_run(tmp_path / "results", "full", None, [record(0, 1.0)], dataset="qa", primary="qa_f1")
    monkeypatch.chdir(tmp_path / "results")
    assert report_main([str(a), os.path.relpath(b)]) == 0    # .../qa/smollm2-135m/{snapkv,full}/...: their parent
    out = tmp_path / "results" / "qa" / "smollm2-135m" / "report"
    assert (out / "table.md").is_file()
    assert capsys.readouterr().err.splitlines()[-1] == f"report: wrote 3 files to {out}"
    assert report_main([str(a), "/"]) == 1                   # nothing in common but the root: ask for --out
    assert capsys.readouterr().err == f"kvbench: report: {a} / share no folder below /; pass --out to say where " \
                                      "the report goes\n"


# --- damaged manifests ------------------------------------------------------------------------------------------

FIX = ("restore it, or delete it and rerun the run's command (it resumes from predictions.jsonl and writes a new "
       "manifest; the cost of earlier sessions is lost)")


def test_damaged_manifest_is_one_line_naming_the_file(tmp_path: Path):
    run = make_run(tmp_path, "snapkv", 64, [record(0, 1.0)])
    (run / "manifest.json").write_text('{\n "method": "snapkv",\n "budget": ')       # truncated mid-write
    with pytest.raises(ValueError) as e:
        read_manifest(run)
    # the parser stops at line 3, column 12: after ` "budget": ` (11 characters) a value was expected
    where = "line 3 column 12: Expecting value"
    assert str(e.value) == f"report: {run / 'manifest.json'} is not valid JSON ({where}); {FIX}"
    (run / "manifest.json").write_text('["snapkv", 64]')                            # JSON, but not a manifest
    with pytest.raises(ValueError, match=r"holds a JSON list, not an object; restore it"):
        read_manifest(run)


def test_cli_damaged_manifest_exits_1_with_one_line(tmp_path: Path, capsys):
    run = make_run(tmp_path / "results", "snapkv", 64, [record(0, 1.0)])
    (run / "manifest.json").write_text('{"method": "snapkv",')
    expected = f"kvbench: report: {run / 'manifest.json'} is not valid JSON (line 1 column 21: Expecting property " \
               f"name enclosed in double quotes); {FIX}\n"
    for extra in ([], ["--paper", "pyramidkv"]):   # --paper too: a damaged run is not a run that was never made
        assert report_main([str(tmp_path / "results"), "--out", str(tmp_path / "out"), *extra]) == 1
        assert capsys.readouterr().err == expected
    assert not (tmp_path / "out").exists()
