"""One failing sample never stops a run: failure records, n_failed, retry on rerun, clean stops on SIGTERM / Ctrl-C.

Through the command line on the tiny random model, with components built to fail (tests/unit/faulty.py)."""
from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvbench.runs.store import RunStore, aggregate, write_json_atomic
from tests.unit.test_cli import ENV, ROOT, records, run_dirs, run_here

THREE = ["dataset.context_lengths=[300]", "dataset.depth_percents=[0,50,100]"]


def faulty_args(tmp_path: Path) -> list[str]:
    return ["model=tiny_llama", "method=snapkv", "budget=64", *THREE,
            "method._target_=tests.unit.faulty.OutOfMemorySnapKV", f"+method.oom_flag={tmp_path / 'oom'}",
            "dataset._target_=tests.unit.faulty.FaultyNeedle", "+dataset.fail_id=niah-L300-d50",
            f"+dataset.fail_flag={tmp_path / 'fail'}"]


def test_failed_samples_are_recorded_counted_and_retried(tmp_path, caplog):
    results = tmp_path / "results"
    (tmp_path / "oom").touch()   # the first sample (d0) runs out of memory during compression
    (tmp_path / "fail").touch()  # the second (d50) raises in its scorer; the third finishes
    caplog.set_level(logging.INFO, logger="kvbench")
    run_dir = run_here(*faulty_args(tmp_path), results=results)  # in this process: three runs, no process start-up
    assert run_dirs(results) == [run_dir]
    recs = {r["id"]: r for r in records(run_dir)}
    oom, bad, good = recs["niah-L300-d0"], recs["niah-L300-d50"], recs["niah-L300-d100"]
    assert oom["failed"] is True and oom["error_type"] == "OutOfMemoryError"
    assert oom["error"] == "CUDA out of memory. Tried to allocate 2.00 GiB (test)"
    assert oom["where"].startswith("kvbench/") and oom["prompt_tokens"] > 64 and oom["budget"] == 64
    assert bad["failed"] is True and bad["error_type"] == "ValueError" and bad["error"] == "a scorer edge case"
    assert "failed" not in good and 0 <= good["score"] <= 1
    scores = json.loads((run_dir / "scores.json").read_text())
    assert scores["n"] == 1 and scores["n_failed"] == 2 and scores["failed_ids"] == ["niah-L300-d0", "niah-L300-d50"]
    assert scores["metrics"]["pyramidkv_recall"] == good["score"]  # failures are excluded, not scored 0
    assert "over 1 samples (2 failed)" in caplog.records[-1].getMessage()  # the run's last log line (run.log)
    assert "n_failed: 2" in (run_dir / "summary.md").read_text()

    assert run_here(*faulty_args(tmp_path), "retry_failed=false", results=results) == run_dir
    assert len(records(run_dir)) == 3 and json.loads((run_dir / "scores.json").read_text())["n_failed"] == 2

    with open(run_dir / "predictions.jsonl", "a") as f:
        f.write('{"note": "a line edited by hand, valid JSON without an id"}\n')
    caplog.clear()
    assert run_here(*faulty_args(tmp_path), results=results) == run_dir
    assert "set aside 1 invalid line(s) (line 4: no string 'id')" in caplog.text  # moved out, not deleted
    (aside,) = [json.loads(x) for x in (run_dir / "predictions.quarantine.jsonl").read_text().splitlines()]
    assert aside["line"] == 4 and json.loads(aside["text"]) == {"note": "a line edited by hand, valid JSON without an id"}
    lines = records(run_dir)
    assert [r.get("id") for r in lines[3:]] == ["niah-L300-d0", "niah-L300-d50"]
    assert not any(r.get("failed") for r in lines[4:])
    scores = json.loads((run_dir / "scores.json").read_text())
    assert scores["n"] == 3 and scores["n_failed"] == 0 and scores["failures_counted_as"] == "excluded"


def ctrl_c_as_from_a_terminal() -> None:
    """SIGINT handled as Python's default, whatever this test inherited: a shell that starts a job in the background
    (CI scripts, `cmd &`) leaves SIGINT ignored, and an ignored signal stays ignored across exec."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def signal_each_after_its_first_record(procs: dict) -> None:
    waiting = dict(procs)
    while waiting:  # each run either writes its first record or ends: no deadline a loaded machine could reach
        for signum, (results, proc) in list(waiting.items()):
            found = list(results.rglob("predictions.jsonl"))
            if proc.poll() is not None or (found and found[0].read_text().count("\n") >= 1):
                proc.send_signal(signum)
                del waiting[signum]
        time.sleep(0.05)


def test_sigterm_and_ctrl_c_stop_the_run_cleanly_keeping_what_is_written(tmp_path):
    """SIGTERM (what SLURM sends before a kill) and SIGINT (Ctrl-C), to two runs at once: exit 143 / 130 with one
    line, every record written so far whole, no temp files, the run-dir lock released. Each run is signalled once its
    first record is on disk; its dataset (faulty.HeldNeedle) holds it in the second sample until then, so neither can
    have finished first, whatever the machine's speed."""
    procs = {}
    for signum in (signal.SIGTERM, signal.SIGINT):
        results = tmp_path / signal.Signals(signum).name
        args = ["model=tiny_llama", "method=snapkv", "budget=64", *THREE,
                "dataset._target_=tests.unit.faulty.HeldNeedle", f"+dataset.release={tmp_path / 'never'}",
                "dataset.metrics=[pyramidkv_recall]",  # one metric: ROUGE's import (nltk) costs ~1.3 s of CPU
                f"results_dir={results}"]
        procs[signum] = (results, subprocess.Popen([sys.executable, "-m", "kvbench.run", *args], cwd=ROOT, env=ENV,
                                                   stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                                   preexec_fn=ctrl_c_as_from_a_terminal))
    try:
        signal_each_after_its_first_record(procs)
        stderrs = {signum: proc.communicate()[1] for signum, (_, proc) in procs.items()}
    finally:
        for _, proc in procs.values():
            if proc.poll() is None:  # a run the signal did not stop would wait in HeldNeedle for ever
                proc.kill()
    for signum, (results, proc) in procs.items():
        stderr = stderrs[signum]
        assert proc.returncode == 128 + signum, stderr
        last = stderr.strip().splitlines()[-1]
        assert last.startswith("kvbench: stopped by SIGTERM" if signum == signal.SIGTERM else "kvbench: interrupted")
        assert last.endswith("every finished sample is kept, rerun the same command to resume")
        (run_dir,) = run_dirs(results)
        assert len(records(run_dir)) == 1  # the one record, whole (json.loads would raise on a torn line)
        assert not (run_dir / "scores.json").exists()
        assert not [p for p in run_dir.iterdir() if ".tmp" in p.name]
        RunStore(run_dir).close()  # the lock was released


def mapped(library: str):
    """Whether a process has loaded a shared library: a moment of its start-up seen from outside, whatever its speed."""
    def seen(pid: int) -> bool:
        try:
            return library in Path(f"/proc/{pid}/maps").read_text()
        except OSError:  # it ended
            return True
    return seen


def test_ctrl_c_while_starting_is_one_line(tmp_path):
    """Ctrl-C in the first seconds of `python -m kvbench.run` (issue 42: a KeyboardInterrupt traceback): right after
    the process starts, while Hydra loads (PyYAML's C loader mapped) and while the command line's checks import
    torch (libtorch mapped). Each ends with code 130 and at most one line, `kvbench: interrupted; ...`, never a
    traceback (before Python installs its handler the signal just ends it: -SIGINT, no output)."""
    moments = {"at-once": lambda pid: True, "hydra": mapped("_yaml."), "torch": mapped("libtorch")}
    for name, reached in moments.items():
        proc = subprocess.Popen([sys.executable, "-m", "kvbench.run", "model=tiny_llama", "method=snapkv", *THREE,
                                 f"results_dir={tmp_path / name}"], cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, preexec_fn=ctrl_c_as_from_a_terminal)
        while proc.poll() is None and not reached(proc.pid):
            time.sleep(0.005)
        proc.send_signal(signal.SIGINT)
        stderr = proc.communicate()[1].strip()
        assert proc.returncode in (130, -signal.SIGINT) and "Traceback" not in stderr, (name, stderr)
        assert stderr in ("", "kvbench: interrupted; every finished sample is kept, rerun the same command to "
                              "resume"), (name, stderr)
        if name != "at-once":
            assert proc.returncode == 130, (name, stderr)


def test_failure_records_in_the_store_and_aggregate(tmp_path):
    def rec(i, score):
        return {"id": f"s{i}", "score": score, "scores": {"m": score}, "kv_bytes": 10, "full_kv_bytes": 40,
                "effective_budget": 4.0, "prefill_s": 1.0, "decode_tok_s": 2.0}

    failed = {"id": "s1", "failed": True, "error_type": "ValueError", "error": "x", "where": "?"}
    store = RunStore(tmp_path)
    for r in (rec(0, 1.0), failed, rec(2, 0.0)):
        store.append(r)
    assert store.done_ids() == {"s0", "s2"} and store.done_ids(include_failed=True) == {"s0", "s1", "s2"}
    store.append(rec(1, 0.5))  # the retry supersedes the failure
    store.close()
    summary = aggregate(RunStore(tmp_path).records)
    assert summary["n"] == 3 and summary["n_failed"] == 0 and summary["metrics"] == {"m": 0.5}
    summary = aggregate([rec(0, 1.0), failed, rec(2, 0.0)])
    assert summary["n"] == 2 and summary["n_failed"] == 1 and summary["failed_ids"] == ["s1"]
    assert summary["metrics"] == {"m": 0.5} and summary["failures_counted_as"] == "excluded"


def test_a_failed_decoding_batch_records_its_unfinished_samples():
    from kvbench.data.base import Sample
    from kvbench.runs.failures import fail_remaining

    samples = [Sample(id=f"s{i}", prompt="p", answers=["a"], max_new_tokens=4, meta={"i": i}) for i in range(3)]
    try:
        raise RuntimeError("CUDA error: an illegal memory access\nmore")
    except RuntimeError as e:
        error = e
    records = fail_remaining([(s, [1] * (10 + i), 8) for i, s in enumerate(samples)], {"s1"}, error)
    assert [(r["id"], r["prompt_tokens"], r["budget"], r["meta"]) for r in records] == [
        ("s0", 10, 8, {"i": 0}), ("s2", 12, 8, {"i": 2})]
    assert all(r["failed"] and r["error"] == "CUDA error: an illegal memory access" for r in records)
    assert records[0]["where"].startswith("tests/unit/test_failures.py:")  # no kvbench frame: the innermost one


def test_a_failed_atomic_write_leaves_no_temp_file(tmp_path):
    (tmp_path / "scores.json").mkdir()  # os.replace onto a directory fails after the temp file is written
    with pytest.raises(OSError):
        write_json_atomic(tmp_path / "scores.json", {"a": 1})
    assert [p.name for p in tmp_path.iterdir()] == ["scores.json"]
