"""The report command on damaged, hostile or interrupted input (issue 42, items 8-10): a damaged run is left out and
named while the rest is reported; a manifest that is JSON but not a manifest is one line naming it; Ctrl-C is one
line; `--compare` never marks an interval over two samples; cost.md has grid runs and the full cache; a paper's page
is headed by its tables' names."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvbench.report.__main__ import INTERRUPTED
from kvbench.report.__main__ import main as report_main
from tests.unit.test_report import make_run, record
from tests.unit.test_report_compare import write_run

REPO = Path(__file__).resolve().parents[2]


def lines_of(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


# --- item 9: one damaged run ------------------------------------------------------------------------------------
def test_a_damaged_run_is_named_and_the_others_reported(tmp_path: Path, capsys, caplog):
    root = tmp_path / "results"
    make_run(root, "snapkv", 64, [record(i, 1.0) for i in range(3)])
    bad = make_run(root, "pyramidkv", 64, [record(0, 1.0)], tail="garbage\n" + json.dumps(record(2, 0.0)) + "\n")
    before = (bad / "predictions.jsonl").read_bytes()
    assert report_main([str(root), "--out", str(tmp_path / "out")]) == 0
    out, err = capsys.readouterr()
    assert "| SnapKV |" in out and "| PyramidKV |" not in out
    (warning,) = [r.getMessage() for r in caplog.records if "predictions.jsonl" in r.getMessage()]
    assert warning.startswith(f"report: left out {bad}, the rest is reported: {bad / 'predictions.jsonl'}:2 is not "
                              "a valid record") and "\n" not in warning
    assert (bad / "predictions.jsonl").read_bytes() == before  # the report never repairs a run


def test_a_report_of_damaged_runs_only_is_one_line(tmp_path: Path, capsys):
    bad = make_run(tmp_path / "results", "pyramidkv", 64, [record(0, 1.0)], tail="garbage\n" +
                   json.dumps(record(2, 0.0)) + "\n")
    assert report_main([str(tmp_path / "results"), "--out", str(tmp_path / "out")]) == 1
    last = lines_of(capsys.readouterr().err)[-1]
    assert last.startswith(f"kvbench: report: {bad / 'predictions.jsonl'}:2 is not a valid record")


# --- item 8: manifests that are JSON but wrong ------------------------------------------------------------------
@pytest.mark.parametrize("manifest,problem", [
    ({}, "'method' is missing, not a name"),
    ({"method": None, "budget": 64, "model": "m", "dataset": "niah"}, "'method' is null, not a name"),
    ({"method": "snapkv", "budget": "abc", "model": "m", "dataset": "niah"}, "'budget' is \"abc\", not an integer"),
    ({"method": "snapkv", "budget": True, "model": "m", "dataset": "niah"}, "'budget' is true, not an integer"),
])
def test_a_manifest_that_is_json_but_not_a_manifest_is_one_line_naming_it(tmp_path: Path, capsys, manifest,
                                                                           problem):
    run = make_run(tmp_path / "results", "snapkv", 64, [record(0, 1.0)])
    (run / "manifest.json").write_text(json.dumps(manifest))
    for extra in ([], ["--paper", "pyramidkv"]):
        assert report_main([str(tmp_path / "results"), "--out", str(tmp_path / "out"), *extra]) == 1
        (line,) = lines_of(capsys.readouterr().err)
        assert line.startswith(f"kvbench: report: {run / 'manifest.json'} is not a kvbench manifest ({problem}")
    assert not (tmp_path / "out").exists()


def test_ctrl_c_during_a_report_is_one_line(tmp_path: Path):
    """A real `python -m kvbench.report` and a real SIGINT, sent once the report is writing (its table.md exists):
    the `--html` page is a named pipe nobody reads, so the report waits there until the signal comes."""
    root = tmp_path / "results"
    make_run(root, "snapkv", 64, [record(i, 1.0) for i in range(3)])
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / "page.html")
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "kvbench.report", str(root), "--out", str(out), "--html",
                             str(out / "page.html")], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    while not (out / "table.md").is_file() and proc.poll() is None:
        time.sleep(0.05)  # polling the file system, no deadline: a loaded machine only takes longer
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate()
    assert proc.returncode == 130
    assert lines_of(stderr) == [INTERRUPTED] and "Traceback" not in stdout


# --- item 10: report details --------------------------------------------------------------------------------------
def test_compare_over_two_samples_marks_nothing_and_says_so(tmp_path: Path, capsys):
    ids = ["niah-1000-0", "niah-1000-50"]
    write_run(tmp_path, "full", None, {i: 1.0 for i in ids})
    write_run(tmp_path, "snapkv", 64, {i: 0.0 for i in ids})  # both missed: the interval is [-100, -100]
    assert report_main([str(tmp_path), "--out", str(tmp_path / "out"), "--compare", "full"]) == 0
    out = capsys.readouterr().out
    snap = next(line for line in out.splitlines() if "| SnapKV |" in line)
    assert "-100.00 [-100.00, -100.00] |" in snap and "†" not in snap
    assert "Too few paired samples for a test (under 10), never marked: SnapKV 64: n=2." in out
    csv = (tmp_path / "out" / "table.csv").read_text()
    assert "True" not in csv.split("\n", 2)[1] + csv.split("\n", 2)[2]  # diff_excludes_0 is False


def test_cost_lists_grid_runs_and_names_the_full_cache(tmp_path: Path, capsys):
    full = make_run(tmp_path / "results", "full", None, [record(0, 1.0)])
    grid = make_run(tmp_path / "results", "snapkv", 64, [record(0, 1.0)])
    sessions = [{"host": "h1", "started_utc": "t", "wall_s": 7200.0, "gpus": 0, "gpu_s": 0.0, "job_id": None}]
    for run, extra in ((full, {"cost": {"wall_s": 7200.0, "gpu_s": 0.0, "hosts": ["h1"], "sessions": sessions}}),
                       (grid, {"launcher": "grid", "wall_s": 3600.0, "grid_configs": 3,
                               "hardware": {"device": "cpu"}})):
        manifest = json.loads((run / "manifest.json").read_text())
        (run / "manifest.json").write_text(json.dumps({**manifest, **extra}))
    assert report_main([str(tmp_path / "results"), "--out", str(tmp_path / "out")]) == 0
    cost = (tmp_path / "out" / "cost.md").read_text().splitlines()
    assert cost == ["GPU-hours 0.00 | wall-hours 2.00 | niah | smollm2-135m | full | all (1 samples on h1)",
                    "GPU-hours 0.00 | wall-hours 1.00 | niah | smollm2-135m | snapkv | b64 (1 samples, grid: its "
                    "group's time, shared by 3 configurations)"]


def test_a_papers_page_is_headed_by_its_tables(tmp_path: Path, capsys):
    make_run(tmp_path / "results", "snapkv", 64, [record(0, 1.0)])
    page = tmp_path / "t15.html"
    assert report_main([str(tmp_path / "results"), "--out", str(tmp_path / "out"), "--paper", "pyramidkv",
                        "--table", "t15", "--html", str(page)]) == 0
    text = page.read_text()
    assert "<h2>Table 15" in text and "<h2>paper_pyramidkv" not in text and text.count("<h2>Table ") >= 1
