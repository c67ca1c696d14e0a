"""A merge never loses a finished record (issue 42, item 1): shards merged into a run directory whose
predictions.jsonl already holds records keep every one of them, byte for byte, and add only what is new."""
from __future__ import annotations

import json

import pytest

from kvbench.runs.merge import merge
from tests.unit.test_cli import records, run_here
from tests.unit.test_store import rec

NEEDLE = ["model=tiny_llama", "method=snapkv", "budget=64", "dataset.context_lengths=[300,400]",
          "dataset.depth_percents=[0,100]", "dataset.metrics=[pyramidkv_recall]"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished unsharded run of 4 samples (its bytes), run once for the module."""
    results = tmp_path_factory.mktemp("finished")
    run_dir = run_here(*NEEDLE, results=results)
    return results, run_dir, (run_dir / "predictions.jsonl").read_bytes()


@pytest.mark.parametrize("limit", [["limit=2"], []])
def test_shards_into_a_finished_run_keep_every_finished_record(finished, tmp_path, limit):
    """As a user meets it: 4 samples run to the end, then `shard=0/2` and `shard=1/2` (with or without `limit`)
    into the same results_dir: the same folder, so the last shard merges. The shards run none of the samples already
    predicted there; every record predictions.jsonl held is still there, byte for byte and first; scores.json covers
    the shards' samples with the records the file holds."""
    results, run_dir, before = finished
    copy = tmp_path / run_dir.relative_to(results)
    copy.parent.mkdir(parents=True)
    copy.mkdir()
    for f in run_dir.iterdir():
        if f.is_file():
            (copy / f.name).write_bytes(f.read_bytes())
    for i in range(2):
        assert run_here(*NEEDLE, *limit, f"shard={i}/2", results=tmp_path) == copy
    after = (copy / "predictions.jsonl").read_bytes()
    assert after == before  # the shards' samples were all finished already: nothing added, nothing dropped
    kept = [json.loads(x) for x in before.splitlines()]
    scores = json.loads((copy / "scores.json").read_text())
    n = 2 if limit else 4
    assert scores["n"] == n
    assert set(json.loads((copy / "manifest.json").read_text())["shards"]) == {"shard-0-of-2", "shard-1-of-2"}
    shard_records = [r for i in range(2) for r in map(json.loads, (copy / f"predictions.shard-{i}-of-2.jsonl").open())]
    assert shard_records == []  # every sample of theirs was finished already: the shards ran none again
    run_ids = json.loads((copy / "manifest.shard-0-of-2.json").read_text())["sample_ids"]
    assert len(run_ids) == n
    assert scores["metrics"]["pyramidkv_recall"] == pytest.approx(
        sum(r["score"] for r in kept if r["id"] in run_ids) / n)


def test_shards_into_a_half_finished_run_run_only_what_is_missing(finished, tmp_path):
    """predictions.jsonl holds 2 of the 4 samples: the two shards run exactly the other 2 between them (not again
    what is there), and the merge appends them after the held lines."""
    results, run_dir, before = finished
    copy = tmp_path / run_dir.relative_to(results)
    copy.mkdir(parents=True)
    (copy / "config.yaml").write_bytes((run_dir / "config.yaml").read_bytes())
    held = b"".join(before.splitlines(keepends=True)[:2])
    (copy / "predictions.jsonl").write_bytes(held)
    for i in range(2):
        assert run_here(*NEEDLE, f"shard={i}/2", results=tmp_path) == copy
    all_ids = [json.loads(x)["id"] for x in before.splitlines()]
    ran = [r["id"] for i in range(2) for r in map(json.loads, (copy / f"predictions.shard-{i}-of-2.jsonl").open())]
    assert sorted(ran) == sorted(all_ids[2:])
    after = (copy / "predictions.jsonl").read_bytes()
    assert after.startswith(held) and sorted(json.loads(x)["id"] for x in after.splitlines()) == sorted(all_ids)
    assert json.loads((copy / "scores.json").read_text())["n"] == 4


def shard_files(run_dir, by_shard: dict[int, list[dict]], count: int = 2, ids: list[str] | None = None) -> None:
    """Finished shard files written by hand (what `shard=i/n` leaves), for merges without a model."""
    from kvbench.runs.shard import Shard

    ids = ids or [r["id"] for i in sorted(by_shard) for r in by_shard[i]]
    for i, recs in by_shard.items():
        shard = Shard(i, count)
        (run_dir / shard.predictions_name).write_text("".join(json.dumps(r) + "\n" for r in recs))
        (run_dir / shard.manifest_name).write_text(json.dumps(
            {"dataset": "niah", "method": "snapkv", "budget": 64, "shard": f"{i}/{count}", "sample_ids": ids,
             "n_shard_samples": len(recs), "started_utc": "2026-01-01T00:00:00+00:00",
             "finished_utc": "2026-01-01T00:01:00+00:00",
             "cost": {"sessions": [{"host": "h", "started_utc": f"2026-01-01T00:00:0{i}+00:00", "wall_s": 1.0,
                                    "gpus": 0, "gpu_s": 0.0, "job_id": None}]}}))


def test_the_record_already_in_predictions_wins_and_a_failure_gives_way(finished, tmp_path):
    """Both files hold a finished record of an id: the one predictions.jsonl held stays (DESIGN.md, "Nothing
    lost": a flushed record is never rewritten); the shard's stays in its shard file. An id whose record there is a
    failure gets the shard's prediction after it; an id it lacks is added."""
    _, run_dir, _ = finished
    (tmp_path / "config.yaml").write_bytes((run_dir / "config.yaml").read_bytes())
    from kvbench.runs.shard import assign

    ids = [r["id"] for r in records(run_dir)]
    owned = assign(ids, 2)
    mine = {i: [dict(rec(0, 0.0), id=x) for x in owned[i]] for i in range(2)}  # the shards scored 0
    old_ok, old_failed = owned[0][0], owned[1][0]
    failure = {"id": old_failed, "failed": True, "error_type": "RuntimeError", "error": "boom", "where": None}
    held = (json.dumps(dict(rec(0, 1.0), id=old_ok)) + "\n" + json.dumps(failure) + "\n").encode()
    (tmp_path / "predictions.jsonl").write_bytes(held)
    shard_files(tmp_path, mine, ids=ids)
    summary = merge(tmp_path)
    after = (tmp_path / "predictions.jsonl").read_bytes()
    assert after.startswith(held)
    added = [json.loads(x) for x in after[len(held):].splitlines()]
    assert [r["id"] for r in added] == [x for x in ids if x != old_ok]  # in the run's order, each once
    assert all(r["score"] == 0.0 for r in added)
    assert summary["n"] == 4 and summary["n_failed"] == 0
    assert summary["metrics"]["m"] == pytest.approx(1 / 4)  # old_ok's 1.0 counts, not its shard's 0.0
    assert merge(tmp_path)["n"] == 4 and (tmp_path / "predictions.jsonl").read_bytes() == after  # idempotent


def test_a_damaged_line_in_predictions_is_set_aside_not_dropped(finished, tmp_path):
    """The file the merge adds to holds an invalid line mid-file: it goes to the quarantine file (as a run does),
    every valid line stays, and the merge goes on."""
    _, run_dir, _ = finished
    (tmp_path / "config.yaml").write_bytes((run_dir / "config.yaml").read_bytes())
    from kvbench.runs.shard import assign

    ids = [r["id"] for r in records(run_dir)]
    owned = assign(ids, 2)
    shard_files(tmp_path, {i: [dict(rec(0, 0.0), id=x) for x in owned[i]] for i in range(2)}, ids=ids)
    good = json.dumps(dict(rec(0, 1.0), id=ids[0])) + "\n"
    (tmp_path / "predictions.jsonl").write_text("garbage\n" + good)
    assert merge(tmp_path)["n"] == 4
    lines = (tmp_path / "predictions.jsonl").read_text().splitlines(keepends=True)
    assert lines[0] == good and len(lines) == 4
    (aside,) = map(json.loads, (tmp_path / "predictions.quarantine.jsonl").read_text().splitlines())
    assert aside["line"] == 1 and aside["text"] == "garbage"


def test_a_merge_stopped_between_its_writes_is_merged_again_by_the_report(finished, tmp_path):
    """merge writes predictions.jsonl, then scores.json, then manifest.json. Killed after the first write, the
    folder holds new predictions and the old scores: the report's `merge_stale` must see it as stale and merge again
    (it looked at predictions.jsonl against the shard files only, so scores.json stayed stale for ever)."""
    import os

    from kvbench.runs.merge import merge_stale, stale
    from kvbench.runs.shard import assign

    _, run_dir, _ = finished
    (tmp_path / "config.yaml").write_bytes((run_dir / "config.yaml").read_bytes())
    ids = [r["id"] for r in records(run_dir)]
    owned = assign(ids, 2)
    shard_files(tmp_path, {i: [dict(rec(0, 1.0), id=x) for x in owned[i]] for i in range(2)}, ids=ids)
    assert stale(tmp_path)
    merge(tmp_path)
    assert not stale(tmp_path)
    scores = tmp_path / "scores.json"
    scores.write_text("{}")  # what an earlier merge left, now older than the predictions the stopped merge wrote
    later = (tmp_path / "predictions.jsonl").stat().st_mtime_ns + 10**9
    os.utime(tmp_path / "predictions.jsonl", ns=(later, later))
    os.utime(tmp_path / "manifest.json", ns=(later, later))
    assert stale(tmp_path)
    merge_stale([tmp_path])
    assert json.loads(scores.read_text())["n"] == 4 and not stale(tmp_path)
    (tmp_path / "manifest.json").unlink()  # stopped before its last write
    assert stale(tmp_path)
