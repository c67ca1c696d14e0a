"""The report's uncertainty: `--stderr` cells, `--compare METHOD` paired-bootstrap marks, on real run directories."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvbench.metrics.stats import paired_bootstrap
from kvbench.report import load_runs, summary_table, to_latex, to_markdown
from kvbench.report import longbench as lb_report
from kvbench.report import ruler as ruler_report
from kvbench.report.__main__ import main
from kvbench.report.compare import Compare, reference_key

REPO = Path(__file__).resolve().parents[2]
IDS = [f"niah-{n}-{d}" for n in (1000, 2000, 3000, 4000) for d in (0, 25, 50, 75, 100)]


def write_run(root: Path, method: str, budget: int | None, scores: dict[str, float], dataset: str = "niah",
              meta=lambda i: {}) -> Path:
    """A run directory as kvbench.run writes it (manifest + predictions.jsonl), records in the given order."""
    run = root / dataset / "smollm2-135m" / method / f"b{budget}-abcd1234"
    run.mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({
        "method": method, "budget": budget, "ratio": None, "model": "smollm2-135m", "dataset": dataset,
        "dataset_version": "1", "primary_metric": "pyramidkv_recall"}))
    lines = [json.dumps({"id": i, "score": s, "scores": {"pyramidkv_recall": s}, "meta": meta(i), "kv_bytes": 10,
                         "full_kv_bytes": 100, "effective_budget": 64.0, "prefill_s": 1.0, "decode_tok_s": 5.0})
             for i, s in scores.items()]
    (run / "predictions.jsonl").write_text("\n".join(lines) + "\n")
    return run


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    """FullKV right on all 20 ids; SnapKV misses 6 (ids shuffled, one id missing, one id full never ran);
    PyramidKV misses 1 (a difference the bootstrap cannot tell from 0)."""
    root = tmp_path / "results"
    rng = random.Random(1)
    write_run(root, "full", None, {i: 1.0 for i in IDS})
    snap = {i: 0.0 if k % 3 == 0 else 1.0 for k, i in enumerate(IDS[:-1])} | {"niah-9000-0": 1.0}
    write_run(root, "snapkv", 64, dict(rng.sample(list(snap.items()), len(snap))))
    write_run(root, "pyramidkv", 64, {i: 0.0 if k == 7 else 1.0 for k, i in enumerate(IDS)})
    return root


def test_cli_prints_the_marked_table_with_standard_errors(sweep: Path, tmp_path: Path):
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "kvbench.report", str(sweep), "--out", str(tmp_path / "out"),
                           "--compare", "full", "--stderr", "--html", str(tmp_path / "out" / "report.html")],
                          cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "Δ vs FullKV [95% CI]" in lines[0]
    # SnapKV: 19 paired ids, 7 of them wrong (k = 0, 3, ..., 18): 12/19 right; se over its 20 records
    snap_scores = np.array([0.0 if k % 3 == 0 else 1.0 for k in range(19)] + [1.0])
    se = 100 * snap_scores.std(ddof=1) / np.sqrt(20)
    snap = {i: 0.0 if k % 3 == 0 else 1.0 for k, i in enumerate(IDS[:-1])}
    ci = paired_bootstrap([snap[i] - 1.0 for i in sorted(snap)]).scaled(100)    # pairs go in id order
    snap_line = next(line for line in lines if "| SnapKV |" in line)
    assert f"| {100 * snap_scores.mean():.2f} ± {se:.2f} |" in snap_line
    assert f"| {ci.diff:+.2f} [{ci.lo:+.2f}, {ci.hi:+.2f}]† |" in snap_line and ci.diff == pytest.approx(-700 / 19)
    pyr_line = next(line for line in lines if "| PyramidKV |" in line)
    assert "| -5.00 [" in pyr_line and "†" not in pyr_line            # 1 miss in 20: interval reaches 0
    assert "| 100.00 ± 0.00 | – |" in next(line for line in lines if "| FullKV |" in line)
    assert "95% paired-bootstrap interval of the difference to FullKV excludes 0" in proc.stdout
    assert "2000 resamples, seed 0" in proc.stdout
    assert "Unpaired samples, excluded: SnapKV 64: 1 ids only in this run, 1 only in FullKV's." in proc.stdout
    csv = pd.read_csv(tmp_path / "out" / "table.csv")
    assert {"se", "diff", "diff_lo", "diff_hi", "n_paired", "resamples", "seed"} <= set(csv.columns)
    assert csv.loc[csv["method"] == "snapkv", "n_paired"].item() == 19
    page = (tmp_path / "out" / "report.html").read_text(encoding="utf-8")        # the HTML page shows the same
    assert f"<td>{ci.diff:+.2f} [{ci.lo:+.2f}, {ci.hi:+.2f}]†</td>" in page and "2000 resamples, seed 0" in page


def test_pairing_ignores_record_order_and_tables_without_flags_are_unchanged(sweep: Path, tmp_path: Path):
    df = load_runs([sweep])
    table = summary_table(df, Compare("full", resamples=300, seed=4))
    shuffled = df.sample(frac=1.0, random_state=0)
    again = summary_table(shuffled, Compare("full", resamples=300, seed=4))
    cols = ["diff", "diff_lo", "diff_hi", "n_paired"]
    pd.testing.assert_frame_equal(table.set_index("method")[cols].sort_index(),
                                  again.set_index("method")[cols].sort_index())
    plain = to_markdown(summary_table(df))
    assert "±" not in plain and "Δ" not in plain and "†" not in plain   # the default table keeps its layout
    tex = to_latex(table, stderr=True)
    assert r"$\pm$" in tex and r"$\Delta$ vs FullKV" in tex and r"\multicolumn{" in tex and "300 resamples" in tex


def test_unknown_reference_is_one_line_naming_the_choices(sweep: Path, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(sweep), "--compare", "snapk", "--out", str(sweep.parent / "o")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith("kvbench: report --compare 'snapk'") and "full, pyramidkv, snapkv" in err


def test_longbench_cells_marks_and_average(tmp_path: Path):
    """Per task and for Avg. (stratified by task): the method loses everything on qasper, nothing on trec."""
    def meta(i: str) -> dict:
        task, index = i.rsplit("-", 1)
        return {"task": task, "index": int(index), "length": 0}
    ids = [f"{t}-{k}" for t in ("qasper", "trec") for k in range(12)]
    write_run(tmp_path, "full", None, {i: 1.0 for i in ids}, dataset="longbench", meta=meta)
    write_run(tmp_path, "snapkv", 128, {i: 0.0 if i.startswith("qasper") else 1.0 for i in ids},
              dataset="longbench", meta=meta)
    df = load_runs([tmp_path])
    df["primary_metric"] = "longbench"
    out = tmp_path / "report"
    lb_report.write_reports(df, out, stderr=True, compare=Compare("full", resamples=200))
    md = (out / "longbench_table.md").read_text()
    snap = next(line for line in md.splitlines() if "| SnapKV |" in line)
    assert "| 0.00 ± 0.00† | 100.00 ± 0.00 | 50.00 ± 0.00† |" in snap   # qasper -100, trec 0, Avg. -50
    csv = pd.read_csv(out / "longbench_table.csv")
    row = csv[csv["method"] == "snapkv"].iloc[0]
    assert (row["diff:qasper"], row["diff:trec"], row["diff:Avg."]) == (-100.0, 0.0, -50.0)
    assert row["se:qasper"] == 0.0 and "200 resamples" in md


def test_ruler_cells_carry_se_and_marks():
    rows = []
    for method, budget, hits in (("full", None, [1] * 10), ("snapkv", 128, [1, 0] * 5)):
        for k, hit in enumerate(hits):
            rows.append({"model": "m", "dataset": "ruler", "dataset_version": "2024-12.1", "method": method,
                         "budget": budget, "ratio": None, "id": f"vt-4096-{k}", "meta.task": "vt",
                         "meta.length": 4096, "references": ["1234567"], "prediction": "1234567" if hit else "",
                         "score": float(hit)})
    df = pd.DataFrame(rows).astype({"budget": "Int64", "ratio": "Float64"})
    scores = ruler_report.task_scores(df)
    table = ruler_report.with_uncertainty(ruler_report.wide_table(scores), scores, df, Compare("full", 500))
    snap = table[table["method"] == "snapkv"].iloc[0]
    assert snap["se:vt"] == pytest.approx(100 * np.std([1, 0] * 5, ddof=1) / np.sqrt(10))
    assert snap["se:Avg."] == pytest.approx(snap["se:vt"]) and snap["diff:vt"] == pytest.approx(-50.0)
    md = ruler_report.to_markdown(table, stderr=True)
    assert f"50.00 ± {snap['se:vt']:.2f}†" in md and "500 resamples" in md
    assert "±" not in ruler_report.to_markdown(ruler_report.with_uncertainty(ruler_report.wide_table(scores),
                                                                             scores, df))


def test_reference_row_is_the_same_budget_or_any_full_cache():
    full = {"method": "full", "budget": 64, "ratio": None}
    snap64 = {"method": "snapkv", "budget": 64, "ratio": None}
    snap128 = {"method": "snapkv", "budget": 128, "ratio": None}
    row = {"method": "pyramidkv", "budget": 128, "ratio": None}
    assert reference_key(row, [full], ["budget", "ratio"]) is full          # the full cache's budget does not matter
    assert reference_key(row, [snap64, snap128], ["budget", "ratio"]) is snap128
    assert reference_key(row, [snap64], ["budget", "ratio"]) is None        # never compare across KV sizes
