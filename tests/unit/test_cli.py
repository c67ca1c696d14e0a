"""The command line on the tiny random model: smoke run, multirun, resume, and one-line errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from kvbench.runs.config import CONFIG_DIR, setup
from kvbench.runs.run import check_command_line, run

ROOT = Path(__file__).resolve().parents[2]
GRID = ["dataset.context_lengths=[400,600]", "dataset.depth_percents=[0,100]"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1"}


def kvbench(*args: str, results: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvbench.run", *args, f"results_dir={results}"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True)


def run_here(*overrides: str, results: Path) -> Path:
    """What `python -m kvbench.run <overrides>` does once its checks pass, in this process (a process costs ~5 s of
    imports): the config Hydra composes, the run directory it names, then `setup` and `run`. Hydra's own files
    (.hydra/, run.log) are not written; the tests that spawn the real command check those."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3", job_name="kvbench"):
        cfg = compose("config", overrides=[*overrides, f"results_dir={results}"], return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)  # the run-dir pattern and `run` read the group choices from it
        run_dir = Path(cfg.hydra.run.dir)
        with open_dict(cfg):
            del cfg["hydra"]  # as in a real run, the job's config has no hydra node
        run(cfg, run_dir, setup(cfg))
    return run_dir


def grid_here(jobs: list[list[str]], results: Path) -> list[Path]:
    """What `python -m kvbench.run -m hydra/launcher=grid ...` runs once Hydra resolved the jobs (each one's
    overrides), in this process: `run_grid` over their configs and run directories; returns those directories."""
    from kvbench.runs.grid import GridJob, run_grid

    grid = []
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3", job_name="kvbench"):
        for overrides in jobs:
            cfg = compose("config", overrides=[*overrides, f"results_dir={results}"], return_hydra_config=True)
            HydraConfig.instance().set_config(cfg)
            run_dir, choices = Path(cfg.hydra.run.dir), dict(cfg.hydra.runtime.choices)
            with open_dict(cfg):
                del cfg["hydra"]
            grid.append(GridJob(cfg, run_dir, {k: choices[k] for k in ("method", "dataset", "model")}))
        run_grid(grid)
    return [job.run_dir for job in grid]


def refusal(*args: str, results: Path) -> str:
    """The one line `python -m kvbench.run` ends with on bad input, checked in this process by what the command runs
    before Hydra (`sys.exit(line)`: exit code 1, the line alone on stderr; the whole path as a process is in
    test_validate.py); nothing may be written under `results`."""
    with pytest.raises(SystemExit) as stop:
        check_command_line([*args, f"results_dir={results}"])
    line = stop.value.code
    assert isinstance(line, str) and line.startswith("kvbench: ") and "\n" not in line, line
    assert not results.exists() or not list(results.iterdir()), list(results.rglob("*"))
    return line


def run_dirs(results: Path) -> list[Path]:
    return sorted(p.parent for p in results.rglob("predictions.jsonl"))


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]


def test_loading_pauses_the_collector_and_leaves_it_as_it_was():
    """`collector_paused` (start-up, model load, data, report) collects the young generation only every LOADING_GEN0
    allocations inside, and restores the thresholds it found, nested too."""
    import gc

    from kvbench.runs.run import LOADING_GEN0, collector_paused

    before = gc.get_threshold()
    with collector_paused():
        assert gc.get_threshold() == (LOADING_GEN0, *before[1:])
        with collector_paused():
            assert gc.get_threshold()[0] == LOADING_GEN0
        assert gc.get_threshold()[0] == LOADING_GEN0
    assert gc.get_threshold() == before and gc.isenabled()


def test_smoke_run_writes_the_run_directory(tmp_path):
    out = kvbench("model=tiny_llama", "method=snapkv", "budget=64", *GRID, results=tmp_path)
    assert out.returncode == 0, out.stderr
    (run_dir,) = run_dirs(tmp_path)
    assert run_dir.relative_to(tmp_path).parts[:4] == ("niah", "tiny-llama", "snapkv", run_dir.name)
    assert run_dir.name.startswith("b64-")
    recs = records(run_dir)
    assert sorted(r["id"] for r in recs) == ["niah-L400-d0", "niah-L400-d100", "niah-L600-d0", "niah-L600-d100"]
    for r in recs:
        assert r["kv_bytes"] < r["full_kv_bytes"] and r["kept_per_layer"] == [64.0, 64.0]
        assert r["effective_budget"] == 64.0 and r["prompt_tokens"] > 64
        assert {"prefill_s", "compress_s", "decode_s", "peak_mem_bytes", "prompt_sha256", "score"} <= set(r)
    scores = json.loads((run_dir / "scores.json").read_text())
    assert scores["n"] == 4 and scores["method"] == "snapkv" and scores["budget"] == 64
    assert scores["metrics"]["pyramidkv_recall"] == pytest.approx(sum(r["score"] for r in recs) / 4)
    values = [r["score"] for r in recs]                                      # se = sample sd / sqrt(n)
    sd = (sum((v - sum(values) / 4) ** 2 for v in values) / 3) ** 0.5
    assert scores["stats"]["pyramidkv_recall"] == {"mean": pytest.approx(sum(values) / 4), "se": pytest.approx(sd / 2),
                                                   "n": 4, "se_method": "sd/sqrt(n)"}
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["model"] == "tiny-llama" and manifest["dataset_version"] == "1" and manifest["finished_utc"]
    assert (run_dir / "config.yaml").is_file() and (run_dir / "heatmap.png").is_file()


def test_tailorkv_run_records_the_byte_ledger(tmp_path):
    run_dir = run_here("model=tiny_llama", "method=tailorkv", "budget=100", "method.start_size=4",
                       "method.recent_size=12", "method.quant_layers=[0]", "dataset.context_lengths=[300]",
                       "dataset.depth_percents=[50]", results=tmp_path)
    assert run_dirs(tmp_path) == [run_dir]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["method_prepared"]["quant_layers"] == [0] and manifest["method"] == "tailorkv-1"
    (record,) = records(run_dir)
    n, topk, steps = record["prompt_tokens"], 100 - 16, record["new_tokens"] - 1
    fp32_row = 2 * 16 * 4  # 2 KV heads x head_dim 16 x 4 bytes (layer 1 is offloaded)
    assert record["transfers"]["h2d_bytes_per_step"]["topk_keys"] == [topk * fp32_row] * steps
    assert record["transfers"]["d2h_prefill_bytes"] == 3 * n * fp32_row
    assert record["host_kv_bytes"] == 3 * n * fp32_row and record["kv_bytes"] < record["full_kv_bytes"]
    assert record["kv_bytes_per_layer"][1] == 2 * 16 * fp32_row + fp32_row  # K/V of 16 sinks + recent, max|K|


@pytest.mark.parametrize("method", ["quest", "pqcache"])
def test_retrieval_runs_record_their_ledgers(tmp_path, method):
    """`method=quest` records the bytes each step reads (page metadata + its pages; the whole cache stays),
    `method=pqcache` the bytes it moves (codes, centroids, top-k K/V; a window token back to the host per step)."""
    extra = (["method.page_size=8", "method.dense_layers=1"] if method == "quest"
             else ["method.sink_size=4", "method.recent_size=8", "method.bits=4"])
    run_dir = run_here("model=tiny_llama", f"method={method}", "budget=48", *extra, "dataset.context_lengths=[300]",
                       "dataset.depth_percents=[50]", results=tmp_path)
    (record,) = records(run_dir)
    n, steps = record["prompt_tokens"], record["new_tokens"] - 1
    fp32_row = 2 * 16 * 4  # 2 KV heads x head_dim 16 x 4 bytes
    if method == "quest":  # layer 1 paged: 6 of its pages per query head, metadata of every page
        pages = [-(-(n + 1 + s) // 8) for s in range(steps)]
        reads = record["transfers"]["read_bytes_per_step"]
        assert reads["page_metadata"] == [2 * p * fp32_row for p in pages]  # min and max
        assert all((n + 1 + s) * fp32_row < r <= (n + 1 + s + 3 * 48) * fp32_row
                   for s, r in enumerate(reads["page_keys"]))  # layer 0 whole + layer 1 <= 3 query heads' pages
        assert record["kv_bytes"] == 2 * 2 * n * fp32_row + 2 * -(-n // 8) * fp32_row and record["host_kv_bytes"] == 0
    else:  # both layers offloaded: 36 candidates fetched, n - 12 candidates' codes, 16 x 8-dim centroids x 2
        moved = record["transfers"]["h2d_bytes_per_step"]
        assert moved["topk_keys"] == [2 * 36 * fp32_row] * steps
        assert moved["pq_codes"] == [2 * 2 * 2 * (n - 12 + s) for s in range(steps)]
        assert record["transfers"]["d2h_bytes_per_step"]["window_keys"] == [0] + [2 * fp32_row] * (steps - 1)
        assert record["kv_bytes"] == 2 * 2 * 12 * fp32_row  # sinks + window K/V of 2 layers


def test_ratio_sets_the_budget_from_each_prompt_length(tmp_path):
    run_dir = run_here("model=tiny_llama", "method=snapkv", "ratio=0.75", *GRID, results=tmp_path)
    assert run_dirs(tmp_path) == [run_dir] and run_dir.name.startswith("r0.75-")
    for r in records(run_dir):
        assert r["budget"] == int(r["prompt_tokens"] * 0.25) and r["effective_budget"] == r["budget"]
    # the run as a whole has no budget (not the config's default 128): its ratio says what it kept
    for name in ("manifest.json", "scores.json"):
        written = json.loads((run_dir / name).read_text())
        assert (written["budget"], written["ratio"]) == (None, 0.75), name
    from kvbench.report import load_runs, summary_table, to_markdown

    table = summary_table(load_runs([run_dir]))
    assert len(table) == 1 and table["budget"].isna().all() and table.loc[0, "ratio"] == 0.75
    assert "| SnapKV | – | 0.75 |" in to_markdown(table)  # KV Size "–", Ratio 0.75


def test_multirun_sweeps_methods_and_budgets(tmp_path):
    out = kvbench("-m", "model=tiny_llama", "method=full,streamingllm", "budget=32,64",
                  "dataset.context_lengths=[300]", "dataset.depth_percents=[50]", results=tmp_path)
    assert out.returncode == 0, out.stderr
    names = {(d.parent.name, d.name.split("-")[0]) for d in run_dirs(tmp_path)}
    assert names == {("full", "all"), ("streamingllm", "b32"), ("streamingllm", "b64")}  # full: one run, no budget
    (full,) = [d for d in run_dirs(tmp_path) if d.parent.name == "full"]
    assert [r["budget"] for r in records(full)] == [None]
    assert json.loads((full / "scores.json").read_text())["budget"] is None


def test_rerun_resumes_repairs_a_torn_line_and_never_duplicates(tmp_path):
    run_dir = run_here("model=tiny_llama", "method=pyramidkv", "budget=32", *GRID, "limit=2", results=tmp_path)
    before = records(run_dir)
    with open(run_dir / "predictions.jsonl", "a") as f:
        f.write('{"id": "niah-L600-d0", "prediction": "half a rec')  # a crash mid-write
    # `limit` is not part of the run's identity: the same dir is resumed
    assert run_here("model=tiny_llama", "method=pyramidkv", "budget=32", *GRID, results=tmp_path) == run_dir
    assert run_dirs(tmp_path) == [run_dir]
    after = records(run_dir)
    assert [r["id"] for r in after].count("niah-L600-d0") == 1
    assert sorted(r["id"] for r in after) == sorted({r["id"] for r in after}) and len(after) == 4
    assert after[:2] == before  # finished work is kept as it was, not recomputed
    assert json.loads((run_dir / "scores.json").read_text())["n"] == 4


@pytest.mark.parametrize("args,expected", [
    (["method=snapk"], "Unknown method 'snapk'. Did you mean: snapkv? Available: ada_pyramidkv, adakv, buzz, "),
    (["dataset=nia"], "Unknown dataset 'nia'. Did you mean: niah?"),
    (["model=smollm"], "Unknown model 'smollm'. Did you mean: smollm2?"),
    (["-m", "method=full,pyramid"], "Unknown method 'pyramid'. Did you mean: pyramidkv?"),
    (["method=snapkv", "budget=16"], "snapkv: window=32 must be < budget=16"),
    (["-m", "hydra/launcher=grid", "method=full,snapkv", "budget=16"], "snapkv: window=32 must be < budget=16"),
    (["method=pyramidkv", "budget=-3"], "pyramidkv: budget=-3 must be a positive integer"),
    (["method=streamingllm", "budget=4"], "streamingllm: budget=4 must be > n_sink=4"),
    (["method=snapkv", "method.pooling=mean"], "pooling='mean' is not one of max, avg, none"),
    (["ratio=1.5"], "ratio=1.5 must be in [0, 1)"),
    (["positions=rope"], "positions='rope' is not one of original, shift"),
    (["batch_size=0"], "batch_size=0 must be a positive integer"),
    (["shard=4/4"], "shard=4/4 must be i/n with n >= 1 and 0 <= i < n"),
    (["method=h2o", "budget=8", "method.recent_size=8"], "h2o: recent_size=8 must be < budget=8"),
    (["dataset.depth_percents=[120]"], "niah:"),
])
def test_bad_input_gets_one_line_error_before_loading(tmp_path, args, expected):
    model = [] if any(a.startswith("model=") for a in args) else ["model=tiny_llama"]
    line = refusal(*model, *args, results=tmp_path / "results")
    assert expected in line, line


def test_help_is_a_usage_paragraph_whose_examples_pass_the_checks(tmp_path):
    """`python -m kvbench.run --help` (issue 42: Hydra's stock 113 lines): what a run is, what the budget means,
    three example commands, where the docs are, then the groups' options (Hydra's help template, configs/config.yaml
    hydra.help); each example passes every check a run makes before loading weights."""
    from kvbench.runs.validate import validate

    out = subprocess.run([sys.executable, "-m", "kvbench.run", "--help"], cwd=ROOT, env=ENV, capture_output=True,
                         text=True)
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and len(lines) <= 40, out.stdout + out.stderr
    for phrase in ("A run is one model x one method x one budget x one dataset", "budget=B keeps B KV entries per "
                   "KV head per layer", "ratio=r", "docs/troubleshooting.md", "method: ", "dataset: "):
        assert phrase in out.stdout, phrase
    examples = [line.split()[3:] for line in lines if line.strip().startswith("python -m kvbench.run ")]
    assert len(examples) == 3
    for args in examples:
        assert validate([*args, f"results_dir={tmp_path}"]) >= 1, args
    assert not list(tmp_path.iterdir())
