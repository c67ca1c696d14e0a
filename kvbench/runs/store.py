"""The run directory: resolved config, manifest, streamed predictions, atomic scores; resume after a crash.

`predictions.jsonl` gets one line per finished sample, flushed and fsynced at once, so a crash loses at most the
sample in flight. On reopen, a torn last line (no newline, or not valid JSON) is cut off, and ids already present
are skipped by the runner: rerunning the same command finishes the job with each id exactly once.

A sample that raised gets a failure record (`"failed": true`, see kvbench/runs/failures.py) instead of a prediction; a
rerun appends the retry after it, and the last record of an id is the one that counts (`latest_per_id`).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import socket
from pathlib import Path
from typing import Any, Iterable

logger = logging.getLogger(__name__)

PREDICTIONS = "predictions.jsonl"
FAILURES_COUNTED_AS = "excluded"  # failed samples are in no mean (LongBench eval.py: missing predictions are skipped)


class RunDirBusy(RuntimeError):
    """Another process holds the run directory."""


def write_text_atomic(path: Path, text: str) -> None:
    """Write to a temp file and rename it over `path`: readers never see half a file, and a failed write (a full
    disk, an interrupt) removes its temp file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def is_failure(record: dict) -> bool:
    return record.get("failed") is True


def latest_per_id(records: Iterable[dict]) -> list[dict]:
    """One record per id in first-seen order: the last one written (a retry supersedes the failure before it), but
    never a failure over a prediction."""
    latest: dict[str, dict] = {}
    for r in records:
        if not (is_failure(r) and r["id"] in latest and not is_failure(latest[r["id"]])):
            latest[r["id"]] = r
    return list(latest.values())


class RunStore:
    """Owns one run directory (or, with `shard`, one shard's file in it). Use `done_ids()` to resume, `append()` per
    sample, `write_scores()` at the end. The lock file names the holder's host and pid (what a cluster user kills)."""

    def __init__(self, run_dir: str | Path, shard=None):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        lock_name = f".lock.{shard.tag}" if shard is not None else ".lock"
        self._lock = open(self.dir / lock_name, "a+")
        try:  # two processes appending to one predictions.jsonl would duplicate ids
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.seek(0)
            holder = self._lock.read().strip() or "another kvbench process"
            self._lock.close()
            what = f"{self.dir} ({shard.tag})" if shard is not None else str(self.dir)
            raise RunDirBusy(f"store: {what} is in use by {holder}; wait for it or stop it")
        self._lock.truncate(0)
        self._lock.write(f"{socket.gethostname()} pid {os.getpid()}\n")
        self._lock.flush()
        self.predictions_path = self.dir / (shard.predictions_name if shard is not None else PREDICTIONS)
        self._records = self._load_and_repair()
        self._file = None

    def _load_and_repair(self) -> list[dict]:
        if not self.predictions_path.exists():
            return []
        raw = self.predictions_path.read_bytes()
        records, good_bytes = [], 0
        for line in raw.splitlines(keepends=True):
            try:
                if not line.endswith(b"\n"):
                    raise ValueError("torn line")
                record = json.loads(line)
            except ValueError:
                logger.warning("%s: dropping a torn or invalid line after %d good records (crash mid-write?)",
                               self.predictions_path, len(records))
                break
            good_bytes += len(line)
            if not isinstance(record, dict) or not isinstance(record.get("id"), str):
                logger.warning("%s: skipping line %d, valid JSON but not a record with an 'id' (edited by hand?)",
                               self.predictions_path, raw[:good_bytes].count(b"\n"))
                continue
            records.append(record)
        if good_bytes != len(raw):
            with open(self.predictions_path, "r+b") as f:
                f.truncate(good_bytes)
        return records

    @property
    def records(self) -> list[dict]:
        return list(self._records)

    def done_ids(self, include_failed: bool = False) -> set[str]:
        """Ids whose latest record is a prediction (plus those that failed, if `include_failed`): resume skips them."""
        return {r["id"] for r in latest_per_id(self._records) if include_failed or not is_failure(r)}

    def append(self, record: dict) -> None:
        if self._file is None:
            self._file = open(self.predictions_path, "a", encoding="utf-8")
        self._file.write(json.dumps(record, ensure_ascii=False, default=float) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._records.append(record)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if not self._lock.closed:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()

    def write_json(self, name: str, obj: Any) -> None:
        write_json_atomic(self.dir / name, obj)

    def write_text(self, name: str, text: str) -> None:
        """Atomic, like `write_json`: shards of one run rewrite config.yaml side by side."""
        write_text_atomic(self.dir / name, text)

    def read_json(self, name: str) -> dict | None:
        path = self.dir / name
        return json.loads(path.read_text()) if path.exists() else None


def aggregate(records: Iterable[dict], corpus_metrics: dict | None = None) -> dict:
    """Means over samples of every metric and of the accounting fields (the body of scores.json).

    `stats` adds each metric's standard error and n (kvbench.report.stats.metric_stats), and the dataset's corpus-level
    metrics (not means over samples) with a seeded bootstrap se; `metrics` stays {metric: mean} for old readers.
    Failure records are left out of every mean and counted in `n_failed`: LongBench's eval.py scores whatever the
    prediction file holds, so a sample without a prediction is excluded, not scored 0 (`failures_counted_as`).
    """
    from kvbench.report.stats import metric_stats

    records = latest_per_id(records)
    failed = sorted(r["id"] for r in records if is_failure(r))
    records = [r for r in records if not is_failure(r)]
    if failed:
        return {**aggregate(records, corpus_metrics), "n_failed": len(failed), "failed_ids": failed}
    if not records:
        return {"n": 0, "n_failed": 0, "failures_counted_as": FAILURES_COUNTED_AS, "metrics": {}}

    def mean(key: str) -> float:
        return sum(r[key] for r in records) / len(records)

    metrics = sorted({m for r in records for m in r.get("scores", {})})
    stats = metric_stats(records, corpus_metrics)
    full = mean("full_kv_bytes")
    return {
        "n": len(records), "n_failed": 0, "failures_counted_as": FAILURES_COUNTED_AS,
        "metrics": {m: sum(r["scores"][m] for r in records) / len(records) for m in metrics}
        | {m: s["mean"] for m, s in stats.items() if m not in metrics},
        "stats": stats,
        "kv_bytes_mean": mean("kv_bytes"),
        "full_kv_bytes_mean": full,
        "kv_ratio": mean("kv_bytes") / full if full else None,
        "effective_budget_mean": mean("effective_budget"),
        "prefill_s_mean": mean("prefill_s"),
        "decode_tok_s_mean": mean("decode_tok_s"),
    }
