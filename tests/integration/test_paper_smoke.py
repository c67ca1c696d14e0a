"""Every paper preset's smoke form through its real make target (sweep, the extra runs, the paper report), on the
embedded model: the runs exist with the paper's settings and its `paper` manifest block, and the report prints the
paper's layout with rebuilt cells where the smoke runs could fill them. CI runs this, so the presets cannot rot.

One `make -k -j2 -O reproduce-smoke` (every paper's smoke target, two processes at a time, each target's output in one
block) serves the five tests: the papers' runs are independent processes, so a second core halves the wall time
without changing what runs; each test reads its own paper's runs, report and stdout block."""
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

from kvbench.report import load_runs
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


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[Path, str, str]:
    """(SMOKE_DIR, stdout, stderr) of `make reproduce-smoke`: every paper's smoke form, run once for this module."""
    if shutil.which("make") is None:
        pytest.skip("needs make")
    root = tmp_path_factory.mktemp("smoke")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "MPLBACKEND": "Agg"}
    out = subprocess.run(["make", "--no-print-directory", "-k", "-j2", "-O", "-o", "setup", "reproduce-smoke",
                          f"PYTHON={sys.executable}", f"SMOKE_DIR={root}"],
                         cwd=REPO, env=env, capture_output=True, text=True)
    return root, out.stdout, out.stderr


def report_block(stdout: str, paper: str) -> str:
    """The stdout block of `paper`'s report: from make's echo of its command to the next echoed command (-O keeps a
    target's output together)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if "-m kvbench.report " in line and f"--paper {paper} " in line)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith(sys.executable)), len(lines))
    return "\n".join(lines[start:end])


@pytest.mark.slow
@pytest.mark.parametrize("paper", sorted(EXPECTED))
def test_smoke_form_runs_through_make(paper, smoke):
    root, stdout, stderr = smoke
    failed = [line for line in (stdout + stderr).splitlines() if "***" in line and paper in line]
    assert not failed, "\n".join(failed) + stdout[-3000:] + stderr[-3000:]
    tmp_path = root
    out_stdout = report_block(stdout, paper)
    methods, cells = EXPECTED[paper]
    manifests = [json.loads(p.read_text()) for p in (tmp_path / paper).rglob("manifest.json")
                 if "/lm_eval/" not in str(p)]  # lm-eval's imported runs: keyformer_table_2
    assert {m["method"] for m in manifests} >= methods
    for m in manifests:
        assert m["paper"]["name"] == paper and m["paper"]["choices"] and m["n_samples"] >= 1
    for pred in (tmp_path / paper).rglob("predictions.jsonl"):
        assert pred.read_text().strip()
    assert f"**" in out_stdout and "rebuilt / published" in out_stdout  # the paper's layout, printed
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
        pyramidkv_tables(tmp_path / paper, manifests, out_stdout)
    if paper == "keyformer":  # beam 4 and the code's rule reached the runs; New Pos ran with positions=shift
        cfgs = [yaml.safe_load(p.read_text()) for p in (tmp_path / paper).rglob("cnn_dailymail/*/keyformer/*/config.yaml")]
        assert {c["positions"] for c in cfgs} == {"original", "shift"}
        assert all(c["generation"]["num_beams"] == 4 and c["method"]["selection"] == "code_frozen" for c in cfgs)
        keyformer_table_2(tmp_path / paper, out_stdout)
    if paper == "adakv":  # Table 2 reads the same LongBench sweep (its stand-in model's rows), Figure 6 a needle cell
        rows = list(csv.DictReader((report / "paper_adakv_t2.csv").open()))
        assert any(r["rebuilt"] and r["method"] == "Ada-Pyramid" for r in rows)
        f6 = list(csv.DictReader((report / "paper_adakv_f6.csv").open()))
        assert {r["column"] for r in f6 if r["rebuilt"]} == {"Full Cache avg.", "SnapKV avg.", "Ada-SnapKV avg.",
                                                             "Pyramid avg.", "Ada-Pyramid avg."}
        assert (report / "paper_adakv_f6_needle.png").stat().st_size > 10_000
        assert {m["paper"]["id"] for m in manifests} == {"t1", "f6"} and "No runs here" not in out_stdout
        needle = [m for m in manifests if m["dataset"] == "niah"]
        assert {m["method"] for m in needle} == {"full", "snapkv", "adakv", "pyramidkv", "ada_pyramidkv"}
    if paper == "tailorkv":  # Tables 5, 8 read the LongBench sweep, 15 the InfiniteBench one, 3 both (Math, Code)
        for table, label, column in [("t5", "TailorKV-1", "HQA"), ("t8", "SnapKV ‡", "HQA"),
                                     ("t15", "TailorKV-1", "R.PK"), ("t3", "SnapKV", "Math"),
                                     ("t3", "Llama-3.1-8B", "IB Code")]:
            rows = list(csv.DictReader((report / f"paper_tailorkv_{table}.csv").open()))
            assert any(r["rebuilt"] and r["method"] == label and r["column"] == column for r in rows), table
        long = {"full", "streamingllm", "snapkv", "quest", "pqcache", "tailorkv-1"}  # Tables 15 and 16's sweeps
        for dataset, table in (("infinitebench", "t15"), ("ruler", "t16")):
            runs = [m for m in manifests if m["dataset"] == dataset]
            assert {m["method"] for m in runs} == long and {m["paper"]["id"] for m in runs} == {table}, dataset
            rows = list(csv.DictReader((report / f"paper_tailorkv_{table}.csv").open()))
            for label in ("Quest", "PQCache", "TailorKV-1"):
                assert any(r["rebuilt"] and r["method"] == label for r in rows), (table, label)
            cfg = lambda m: yaml.safe_load(next((tmp_path / paper).rglob(f"{dataset}/*/{m}/*/config.yaml")).read_text())
            tailor, quest, pq = cfg("tailorkv")["method"], cfg("quest")["method"], cfg("pqcache")["method"]
            assert (tailor["start_size"], tailor["recent_size"], tailor["channels"]) == (64, 64, 12)  # Table 7
            assert (quest["page_size"], quest["dense_layers"], pq["kmeans_iters"], pq["sink_size"]) == (16, 2, 1, 64)
        tailorkv_table_16(tmp_path / paper, out_stdout)
    if paper == "buzz":
        cfgs = [yaml.safe_load(p.read_text()) for p in (tmp_path / paper).rglob("buzz/*/config.yaml")]
        assert {c["method"]["logn"] for c in cfgs} == {False, True} and {c["positions"] for c in cfgs} == {"shift"}
        for table in ("tb", "tc"):  # the 40 % sweep fills Tables B and C too (their stand-in model's rows)
            rows = list(csv.DictReader((report / f"paper_buzz_{table}.csv").open()))
            assert any(r["rebuilt"] and r["method"] == "40%" for r in rows), table


def tailorkv_table_16(root: Path, stdout: str) -> None:
    """Table 16's rows are keyed by RULER's 64k / 128k lengths: the smoke form's 512- and 768-token runs stand in for
    them (paper_settings.stand_in), each row reads its own length's records, and the header says so."""
    assert "length 65536 ran as 512; length 131072 ran as 768" in stdout
    records = load_runs([root])
    records = records[records["dataset"] == "ruler"]
    assert set(records["meta.length"]) == {512, 768}
    t16 = {(r["group"], r["method"], r["column"]): r
           for r in csv.DictReader((root / "report" / "tailorkv" / "paper_tailorkv_t16.csv").open())}
    for length, group in ((512, "Llama-3.1-8B-Instruct, 64k"), (768, "Llama-3.1-8B-Instruct, 128k")):
        for method, label in (("full", "Llama-3.1-8B"), ("tailorkv-1", "TailorKV-1"), ("quest", "Quest")):
            mine = records[(records["meta.length"] == length) & (records["method"] == method)]
            assert len(mine) == 1 and float(t16[(group, label, "N-S1")]["rebuilt"]) == 100 * mine["score"].mean()
        assert t16[(group, "Llama-3.1-8B", "N-S2")]["note"] == "task not in the run"


def keyformer_table_2(root: Path, stdout: str) -> None:
    """Table 2 through lm-eval's command line (python -m kvbench.harness, three --model_args in one process) on the
    local look-alike COPA (tests/fixtures/lm_eval): lm-eval's acc is the share of documents whose highest-scored
    choice is the target, the imported records average to it, and they fill the COPA 0-shot cells of the three rows."""
    results = {}  # method -> (lm-eval's acc, its logged documents)
    for path in (root / "lm_eval_out").rglob("results_*.json"):
        result, stamp = json.loads(path.read_text()), path.stem.removeprefix("results_")
        logged = [json.loads(line) for line in path.with_name(f"samples_copa_{stamp}.jsonl").read_text().splitlines()]
        results[result["config"]["model_args"]["method"]] = (result["results"]["copa"]["acc,none"], logged)
    assert set(results) == {"full", "h2o", "keyformer"}
    runs = load_runs([root / "lm_eval"])
    assert set(runs["method"]) == {"full", "h2o", "keyformer"} and set(runs["meta.task"]) == {"copa"}
    assert set(runs["meta.num_fewshot"]) == {0} and set(runs["model"]) == {"smollm2-135m-instruct"}
    for method, (acc, logged) in results.items():
        best = [max(range(len(d["filtered_resps"])), key=lambda i: float(d["filtered_resps"][i][0])) for d in logged]
        assert len(logged) == 2 and acc == sum(b == d["doc"]["label"] for b, d in zip(best, logged)) / 2, method
        assert runs[runs["method"] == method]["scores.acc"].mean() == acc, method
    assert set(runs[runs["method"] != "full"]["ratio"]) == {0.5}
    t2 = {(r["group"], r["method"], r["column"]): r
          for r in csv.DictReader((root / "report" / "keyformer" / "paper_keyformer_t2.csv").open())}
    for label, method in (("Full", "full"), ("H2O", "h2o"), ("Keyformer", "keyformer")):
        cell = t2[("MPT-7B / COPA", label, "0-shot")]
        assert float(cell["rebuilt"]) == pytest.approx(100 * results[method][0])
        assert cell["note"] == "" and t2[("MPT-7B / COPA", label, "5-shot")]["rebuilt"] == ""
    assert "Table 2: few-shot accuracy" in stdout


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
