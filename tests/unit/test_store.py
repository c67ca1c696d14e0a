"""The run store: streamed records, torn-line repair, exclusive use, atomic JSON."""
from __future__ import annotations

import json

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
