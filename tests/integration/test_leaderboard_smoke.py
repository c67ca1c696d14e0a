"""`make leaderboard-smoke`'s protocol on the embedded model, in this process (the suite's time): the smoke
preset composed as its sweep composes each job (paper=kvpress_leaderboard_smoke, query=agnostic, ratio), shrunk
to the full cache and Knorm at two of the four ratios on one of its two RULER tasks with 4 new tokens, each job
run through `kvbench.runs.run`, then the leaderboard report over the run directories: rows in kvpress's schema plus
kvbench's columns. The make target's recipe is checked to run that preset and that report (`make -n`)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from kvbench.report import leaderboard as lb
from kvbench.runs.config import CONFIG_DIR, setup
from kvbench.runs.run import run

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
JOBS = [("full", 0.5), ("knorm", 0.5), ("knorm", 0.875)]  # the sweep's jobs kept here (full runs once whatever ratio)


def job(tmp_path: Path, method: str, ratio: float):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["paper=kvpress_leaderboard_smoke", f"method={method}", f"ratio={ratio}",
                                           "dataset.tasks=[niah_single_1]", "dataset.max_new_tokens=4",
                                           f"results_dir={tmp_path}"],
                      return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    run_dir = Path(cfg.hydra.run.dir)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg, run_dir


def test_leaderboard_smoke_writes_schema_valid_rows(tmp_path):
    for method, ratio in JOBS:
        cfg, run_dir = job(tmp_path, method, ratio)
        assert cfg.query == "agnostic" and cfg.budget is None and cfg.paper_settings.name == "kvpress_leaderboard"
        run(cfg, run_dir, setup(cfg))
    assert lb.main([str(tmp_path / "ruler"), "--out", str(tmp_path / "report")]) == 0
    rows = [json.loads(x) for x in (tmp_path / "report" / "leaderboard.jsonl").read_text().splitlines()]
    assert [(r["method"], r["compression_ratio"]) for r in rows] == [("no_press", 0.0), ("knorm", 0.5),
                                                                     ("knorm", 0.875)]
    for r in rows:
        assert list(r) == [*lb.SCHEMA, *lb.KVBENCH_COLUMNS]
        assert (r["dataset"], r["data_dir"], r["model"]) == ("ruler", "384", "smollm2-135m-instruct")
        assert 0 <= r["score"] <= 100 and (r["n_samples"], r["n_failed"], r["n_tasks"]) == (1, 0, 1)
        assert r["kv_bytes"] > 0 and r["time_s"] > 0
    fractions = [r["kv_fraction"] for r in rows]
    assert fractions[0] == 1.0 and fractions[0] > fractions[1] > fractions[2]  # compression is real
    assert (tmp_path / "report" / "leaderboard.csv").read_text().splitlines()[0].startswith(",".join(lb.SCHEMA))


def test_make_target_runs_the_smoke_preset_and_the_report():
    if shutil.which("make") is None:
        pytest.skip("needs make")
    out = subprocess.run(["make", "-n", "-o", "setup", "leaderboard-smoke", f"PYTHON={sys.executable}",
                          "SMOKE_DIR=/tmp/x"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "-m kvbench.run -m paper=kvpress_leaderboard_smoke results_dir=/tmp/x/leaderboard" in out
    assert "-m kvbench.report.leaderboard /tmp/x/leaderboard --out /tmp/x/leaderboard/report" in out
