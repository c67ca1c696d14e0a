"""Sharded runs end to end on the tiny model: shards as separate processes into one run dir, merge, kill + resume."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvbench.runs.merge import main as merge_main
from kvbench.report.__main__ import main as report_main
from tests.unit.test_cli import ENV, ROOT, records, run_dirs, run_here

# one metric: what these tests check is the launch; ROUGE's import (nltk) costs each process ~1.3 s of CPU
NEEDLE = ["model=tiny_llama", "method=snapkv", "budget=64", "dataset.context_lengths=[300,400]",
          "dataset.depth_percents=[0,50,100]", "dataset.metrics=[pyramidkv_recall]"]
TIMINGS = {"prefill_s", "compress_s", "decode_s", "decode_tok_s", "e2e_s", "peak_mem_bytes"}
SCORE_TIMINGS = {"prefill_s_mean", "decode_tok_s_mean"}


def without(d: dict, keys: set) -> dict:
    return {k: v for k, v in d.items() if k not in keys}


def merge_cli(capsys, *paths: Path) -> SimpleNamespace:
    """`python -m kvbench.merge PATH...`, in-process (its `main`) to spare a Python start."""
    capsys.readouterr()
    code = merge_main([str(p) for p in paths])
    out = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)


def test_three_shards_in_separate_processes_merge_to_the_unsharded_run(tmp_path, capsys):
    """Shards 0 and 1 are `python -m kvbench.run` processes, shard 2 runs in this process (a third process would
    only add its imports), all at the same time into one run dir; whichever finishes last merges."""
    sharded, plain = tmp_path / "sharded", tmp_path / "plain"
    procs = [subprocess.Popen([sys.executable, "-m", "kvbench.run", *NEEDLE, f"shard={i}/3",
                               f"results_dir={sharded}"], cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    here = run_here(*NEEDLE, "shard=2/3", results=sharded)
    plain_dir = run_here(*NEEDLE, results=plain)  # meanwhile, the same config unsharded (in this process)
    for p in procs:
        assert p.wait() == 0, p.stderr.read()
    (run_dir,) = run_dirs(sharded)  # shard is not part of the run's identity: one directory for all three
    assert here == run_dir
    assert run_dirs(plain) == [plain_dir]
    assert run_dir.relative_to(sharded) == plain_dir.relative_to(plain)
    shard_ids = [[r["id"] for r in map(json.loads, (run_dir / f"predictions.shard-{i}-of-3.jsonl").open())]
                 for i in range(3)]
    assert sorted(map(len, shard_ids)) == [2, 2, 2]
    # the last shard to finish merged: records in the dataset's order, identical but for timings
    assert [without(r, TIMINGS) for r in records(run_dir)] == [without(r, TIMINGS) for r in records(plain_dir)]
    scores = json.loads((run_dir / "scores.json").read_text())
    assert without(scores, SCORE_TIMINGS) == without(json.loads((plain_dir / "scores.json").read_text()),
                                                     SCORE_TIMINGS)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert set(manifest["shards"]) == {"shard-0-of-3", "shard-1-of-3", "shard-2-of-3"}
    assert manifest["n_samples"] == 6 and manifest["cost"]["gpu_s"] == 0  # CPU: no GPU-seconds
    assert manifest["cost"]["wall_s"] == pytest.approx(sum(s["wall_s"] for s in manifest["shards"].values()))
    assert (run_dir / "run.shard-0-of-3.log").is_file() and (run_dir / "heatmap.png").is_file()
    # merging again by hand gives the same files
    before = (run_dir / "predictions.jsonl").read_text(), (run_dir / "scores.json").read_text()
    again = merge_cli(capsys, run_dir)
    assert again.returncode == 0, again.stderr
    assert ((run_dir / "predictions.jsonl").read_text(), (run_dir / "scores.json").read_text()) == before
    # the report merges a sharded run by itself, and says what each configuration cost
    (run_dir / "predictions.jsonl").unlink()
    (run_dir / "scores.json").unlink()
    assert report_main([str(sharded), "--out", str(tmp_path / "report")]) == 0
    assert ((run_dir / "predictions.jsonl").read_text(), (run_dir / "scores.json").read_text()) == before
    cost = (tmp_path / "report" / "cost.md").read_text()
    assert cost.startswith("GPU-hours 0.00 | wall-hours ")
    assert "niah | tiny-llama | snapkv | b64 (6 samples, 3 shards" in cost


def test_a_killed_shard_resumes_and_merge_names_missing_shards(tmp_path, capsys):
    """The shard is held after its first record (faulty.HeldNeedle) until it has been killed: it cannot finish
    first, however fast the machine."""
    release = tmp_path / "release"
    grid = [*NEEDLE[:3], NEEDLE[-1], "dataset.context_lengths=[300,400,500]", "dataset.depth_percents=[0,25,50,75]",
            "dataset._target_=tests.unit.faulty.HeldNeedle", f"+dataset.release={release}", "shard=0/2"]
    results = tmp_path / "results"
    proc = subprocess.Popen([sys.executable, "-m", "kvbench.run", *grid, f"results_dir={results}"], cwd=ROOT,
                            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while proc.poll() is None:  # no deadline a loaded machine could reach
        shard_file = next(results.rglob("predictions.shard-0-of-2.jsonl"), None)
        if shard_file is not None and shard_file.read_text().count("\n") >= 1:
            break
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)  # no chance to clean up: as a node failure or an OOM kill
    proc.wait()
    run_dir = shard_file.parent
    written = shard_file.read_text().splitlines()
    assert len(written) == 1

    out = merge_cli(capsys, run_dir)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvbench: merge: "), out.stderr
    assert f"shard-0-of-2 unfinished ({len(written)}/6 samples)" in lines[0]
    assert "shard-1-of-2 missing" in lines[0] and "shard=0/2,1/2" in lines[0]

    release.touch()
    assert run_here(*grid, results=results) == run_dir  # the same command again (in this process): it resumes
    resumed = shard_file.read_text().splitlines()
    assert resumed[:len(written)] == written and len(resumed) == 6  # finished work kept byte for byte
    assert len({json.loads(line)["id"] for line in resumed}) == 6
    assert len(json.loads((run_dir / "manifest.shard-0-of-2.json").read_text())["cost"]["sessions"]) == 2

    out = merge_cli(capsys, run_dir)
    assert out.returncode == 1 and out.stderr.strip().count("\n") == 0
    assert "shard-1-of-2 missing" in out.stderr and "shard-0-of-2" not in out.stderr
    assert not (run_dir / "scores.json").exists()
