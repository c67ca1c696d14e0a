"""The run store: streamed records, torn-line repair, exclusive use, atomic JSON."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbench.runs.store import RunStore, aggregate, write_json_atomic


def rec(i: int, score: float = 1.0) -> dict:
    return {"id": f"s{i}", "score": score, "scores": {"m": score}, "kv_bytes": 10, "full_kv_bytes": 40,
            "effective_budget": 4.0, "prefill_s": 1.0, "decode_tok_s": 2.0}


def test_records_survive_reopen_and_a_torn_line_is_cut(tmp_path):
    store = RunStore(tmp_path)
    store.append(rec(0))
    store.append(rec(1))
    store.close()
    with open(tmp_path / "predictions.jsonl", "a") as f:
        f.write('{"id": "s2", "sco')
    store = RunStore(tmp_path)
    assert store.done_ids() == {"s0", "s1"}
    store.append(rec(2))
    store.close()
    lines = (tmp_path / "predictions.jsonl").read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == ["s0", "s1", "s2"]


def test_a_run_dir_is_used_by_one_process_at_a_time(tmp_path):
    first = RunStore(tmp_path)
    with pytest.raises(RuntimeError, match="is in use by .* pid "):
        RunStore(tmp_path)
    first.close()
    RunStore(tmp_path).close()  # free again once the first one is done


def test_aggregate_means_by_hand():
    summary = aggregate([rec(0, 1.0), rec(1, 0.0), rec(2, 0.5)])
    assert summary["n"] == 3 and summary["metrics"] == {"m": 0.5} and summary["kv_ratio"] == 0.25


def test_atomic_json_leaves_no_temp_file(tmp_path):
    write_json_atomic(tmp_path / "scores.json", {"a": 1})
    assert json.loads((tmp_path / "scores.json").read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["scores.json"]


KILLED_MID_WRITE = """
import os, sys
from pathlib import Path
from kvbench.runs.store import write_json_atomic

def pause(fd):  # the temporary is written and locked; the test kills this process here
    print("ready", flush=True)
    sys.stdin.read()

os.fsync = pause
write_json_atomic(Path(sys.argv[1]) / "manifest.json", {"half": "written"})
"""


def test_a_writer_killed_mid_write_leaves_a_temporary_removed_when_the_run_dir_next_opens(tmp_path):
    """kill -9 inside write_json_atomic (a real process, paused in its fsync) leaves `.manifest.json.tmp<pid>`;
    the store removes it once that writer is dead, never while it lives, and never a file that is not its own."""
    root = Path(__file__).resolve().parents[2]
    store = RunStore(tmp_path)
    store.append(rec(0))
    store.close()
    writer = subprocess.Popen([sys.executable, "-c", KILLED_MID_WRITE, str(tmp_path)], cwd=root, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": str(root)})
    try:
        assert writer.stdout.readline().strip() == "ready"
        temporary = tmp_path / f".manifest.json.tmp{writer.pid}"
        assert json.loads(temporary.read_text()) == {"half": "written"}
        RunStore(tmp_path).close()  # its writer lives: kept
        assert temporary.is_file()
    finally:
        writer.kill()
        writer.wait()  # reaped: a zombie's pid still exists
        writer.stdin.close()
        writer.stdout.close()
    user_file = tmp_path / f"notes.tmp{writer.pid}"  # not a kvbench temporary (no leading dot): never touched
    user_file.write_text("mine")
    store = RunStore(tmp_path)
    assert not temporary.exists() and not (tmp_path / "manifest.json").exists()
    assert user_file.read_text() == "mine"
    assert store.done_ids() == {"s0"}
    store.close()
