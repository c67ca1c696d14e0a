"""Every paper preset's smoke form through its real make target (sweep, the extra runs, the paper report), on the
embedded model: the runs exist with the paper's settings and its `paper` manifest block, and the report prints the
paper's layout with rebuilt cells where the smoke runs could fill them. CI runs this, so the presets cannot rot."""
from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvbench.report.paper import headline_id

REPO = Path(__file__).resolve().parents[2]
# paper -> (methods that must have a run, the rows the smoke runs fill: (row label, column label))
EXPECTED = {
    "pyramidkv": ({"full", "snapkv", "h2o", "streamingllm", "pyramidkv"},
                  [("FKV", "HotpotQA"), ("SKV", "HotpotQA"), ("H2O", "HotpotQA"), ("PyramidKV (Ours)", "HotpotQA")]),
    "adakv": ({"full", "h2o", "streamingllm", "snapkv", "pyramidkv", "adakv", "ada_pyramidkv"},
              [("Full Cache", "HotpotQA"), ("Ada-SnapKV", "HotpotQA"), ("Ada-Pyramid", "HotpotQA")]),
    "tailorkv": ({"full", "streamingllm", "snapkv", "quest", "pqcache", "tailorkv-1", "tailorkv-2"},
                 [("Llama-3.1-8B", "HQA"), ("TailorKV-1", "HQA"), ("TailorKV-2", "HQA"), ("SnapKV", "HQA"),
                  ("Quest", "HQA"), ("PQCache", "HQA")]),
    "keyformer": ({"full", "local", "h2o", "streamingllm_rolling", "keyformer"}, [("Full", "ROUGE-2")]),
    "buzz": ({"buzz", "h2o", "streamingllm_rolling", "local"},
             [("BUZZ", "40%"), ("BUZZ (with logn)", "40%"), ("H2O", "40%"), ("StreamingLLM", "40%"), ("Local", "40%")]),
}


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("paper", sorted(EXPECTED))
def test_smoke_form_runs_through_make(paper, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "MPLBACKEND": "Agg"}
    out = subprocess.run(["make", "--no-print-directory", "-o", "setup", f"reproduce-{paper}-smoke",
                          f"PYTHON={sys.executable}", f"SMOKE_DIR={tmp_path}"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    methods, cells = EXPECTED[paper]
    manifests = [json.loads(p.read_text()) for p in (tmp_path / paper).rglob("manifest.json")]
    assert {m["method"] for m in manifests} >= methods
    for m in manifests:
        assert m["paper"]["name"] == paper and m["paper"]["choices"] and m["n_samples"] >= 1
    for pred in (tmp_path / paper).rglob("predictions.jsonl"):
        assert pred.read_text().strip()
    assert f"**" in out.stdout and "rebuilt / published" in out.stdout  # the paper's layout, printed
    report = tmp_path / paper / "report" / paper
    headline = headline_id(paper)
    assert (report / f"{paper}.html").is_file() and (report / f"paper_{paper}_{headline}.md").is_file()
    rows = list(csv.DictReader((report / f"paper_{paper}_{headline}.csv").open()))
    for label, column in cells:
        cell = [r for r in rows if r["method"] == label and r["column"] == column and r["rebuilt"]]
        assert cell, (label, column)
    if paper == "pyramidkv":  # the paper-era settings reached the runs
        cfg = yaml.safe_load(next((tmp_path / paper).rglob("longbench/*/h2o/*/config.yaml")).read_text())
        assert cfg["method"]["variant"] == "kvcache_factory" and cfg["method"]["granularity"] == "query_head"
        pyramidkv_tables(tmp_path / paper, manifests, out.stdout)
    if paper == "keyformer":  # beam 4 and the code's rule reached the runs; New Pos ran with positions=shift
        cfgs = [yaml.safe_load(p.read_text()) for p in (tmp_path / paper).rglob("keyformer/*/config.yaml")]
        assert {c["positions"] for c in cfgs} == {"original", "shift"}
        assert all(c["generation"]["num_beams"] == 4 and c["method"]["selection"] == "code_frozen" for c in cfgs)
    if paper == "adakv":  # Table 2 reads the same LongBench sweep (its stand-in model's rows)
        rows = list(csv.DictReader((report / "paper_adakv_t2.csv").open()))
        assert any(r["rebuilt"] and r["method"] == "Ada-Pyramid" for r in rows)
        assert "No runs here for f6 of adakv" in out.stdout  # the needle figure: published averages only
    if paper == "tailorkv":  # Tables 5, 8 read the LongBench sweep, 15 the InfiniteBench one, 3 both (Math, Code)
        for table, label, column in [("t5", "TailorKV-1", "HQA"), ("t8", "SnapKV ‡", "HQA"),
                                     ("t15", "TailorKV-1", "R.PK"), ("t3", "SnapKV", "Math"),
                                     ("t3", "Llama-3.1-8B", "IB Code")]:
            rows = list(csv.DictReader((report / f"paper_tailorkv_{table}.csv").open()))
            assert any(r["rebuilt"] and r["method"] == label and r["column"] == column for r in rows), table
        assert "No runs here for t16 of tailorkv" in out.stdout  # RULER at 64k/128k: hand-written records only
        ib = [m for m in manifests if m["dataset"] == "infinitebench"]
        assert {m["method"] for m in ib} == {"full", "streamingllm", "snapkv", "tailorkv-1"}
        assert {m["paper"]["id"] for m in ib} == {"t15"}
        cfg = yaml.safe_load(next((tmp_path / paper).rglob("infinitebench/*/tailorkv/*/config.yaml")).read_text())
        assert (cfg["method"]["start_size"], cfg["method"]["recent_size"], cfg["method"]["channels"]) == (64, 64, 12)
    if paper == "buzz":
        cfgs = [yaml.safe_load(p.read_text()) for p in (tmp_path / paper).rglob("buzz/*/config.yaml")]
        assert {c["method"]["logn"] for c in cfgs} == {False, True} and {c["positions"] for c in cfgs} == {"shift"}
        for table in ("tb", "tc"):  # the 40 % sweep fills Tables B and C too (their stand-in model's rows)
            rows = list(csv.DictReader((report / f"paper_buzz_{table}.csv").open()))
            assert any(r["rebuilt"] and r["method"] == "40%" for r in rows), table


def pyramidkv_tables(root: Path, manifests: list[dict], stdout: str) -> None:
    """One smoke sweep per dataset fills a row of every PyramidKV table kvbench can run; the needle runs carry the
    needle script's settings, the manifests the table and the reading that ran, and the heatmaps are drawn."""
    report = root / "report" / "pyramidkv"
    for table in ("t1", "t2", "t4", "t5", "t6", "t7", "t8", "t11", "t12", "t13", "t14", "t15"):
        rows = list(csv.DictReader((report / f"paper_pyramidkv_{table}.csv").open()))
        assert any(r["rebuilt"] for r in rows), table
    assert "No runs here for t9, t10 of pyramidkv" in stdout  # latency: published only, each cell says why
    assert (report / "paper_pyramidkv_t15_needle.png").stat().st_size > 10_000
    assert {m["paper"]["id"] for m in manifests} == {"t11", "t15"}
    for m in manifests:  # the reading of the paper that ran: the code's, in the presets
        assert m["paper"]["reading"]["pyramidkv_exact"] in (None, False)
        recent = m["paper"]["reading"]["streamingllm_recent"]
        assert recent == (32 if m["method"] == "streamingllm" and m["dataset"] == "niah_pyramidkv" else None)
    snap = yaml.safe_load(next(root.rglob("niah_pyramidkv/*/snapkv/*/config.yaml")).read_text())
    assert snap["method"]["window"] == 32 and snap["method"]["granularity"] == "query_head"
    t15 = {(r["group"], r["method"], r["column"]): r
           for r in csv.DictReader((report / "paper_pyramidkv_t15.csv").open())}
    full = t15[("LLaMa-3-8B, 8k", "KV Cache 64", "Full KV Acc.")]
    assert float(full["rebuilt"]) > 50 and float(full["published"]) == 100.0  # the needle is found with the full cache
