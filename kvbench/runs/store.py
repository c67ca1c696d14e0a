"""The run directory: resolved config, manifest, streamed predictions, atomic scores; resume after a crash.

`predictions.jsonl` gets one line per finished sample, flushed and fsynced at once, so a crash loses at most the
sample in flight. On reopen, a torn last line (no newline, or not valid JSON) is cut off, any other invalid line is
set aside into a quarantine file (never a valid record: kvbench.report.records judges each line), and ids already
present are skipped by the runner: rerunning the same command finishes the job with each id exactly once.

A sample that raised gets a failure record (`"failed": true`, see kvbench/runs/failures.py) instead of a prediction; a
rerun appends the retry after it, and the last record of an id is the one that counts (`latest_per_id`).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterable, Iterator

from kvbench.disk.temporaries import locked_temporary_file, remove_dead_temporaries
from kvbench.report.records import is_failure, latest_per_id, record_problem, scan, with_follow_up_work

logger = logging.getLogger(__name__)

PREDICTIONS = "predictions.jsonl"
FAILURES_COUNTED_AS = "excluded"  # failed samples are in no mean (LongBench eval.py: missing predictions are skipped)


class RunDirError(RuntimeError):
    """A run directory kvbench must not write into as it is; the message is one line saying what to do."""


class RunDirBusy(RunDirError):
    """Another process holds the run directory; `holder` is its host and pid."""

    def __init__(self, what: str, holder: str):
        super().__init__(f"store: {what} is in use by {holder}; wait for it or stop it")
        self.holder = holder


class UnsafeRunDir(RunDirError):
    """A file of the run directory is a link that leads outside it."""


class DamagedFile(RunDirError):
    """A file kvbench reads back (manifest.json) is not what it wrote."""


class DiskFull(RunDirError):
    """No space (or quota) left where a run writes: nothing was torn, a rerun resumes."""


def is_disk_full(e: OSError) -> bool:
    return e.errno in (errno.ENOSPC, errno.EDQUOT)


def disk_full(e: OSError, path: Path | str | None) -> DiskFull:
    where = path or e.filename or "the run directory"
    return DiskFull(f"no space left on the device holding {where} ({e.strerror}); free some space and rerun the "
                    "same command: it resumes, and every finished sample is kept")


@contextlib.contextmanager
def full_disk_names(path: Path | str) -> Iterator[None]:
    """Turn a full disk (ENOSPC, EDQUOT) while writing `path` into a one-line DiskFull naming it."""
    try:
        yield
    except OSError as e:
        if is_disk_full(e):
            raise disk_full(e, path) from None
        raise


def hold(lock_path: Path, what: str):
    """Take the lock file `lock_path` without waiting (its holder's host and pid written into it), or raise
    RunDirBusy naming the holder; returns the open file, whose closing releases the lock."""
    lock = open(lock_path, "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another kvbench process"
        lock.close()
        raise RunDirBusy(what, holder) from None
    lock.truncate(0)
    lock.write(f"{socket.gethostname()} pid {os.getpid()}\n")
    lock.flush()
    return lock


def is_held(lock_path: Path) -> str | None:
    """Who holds `lock_path` now (its host and pid), or None when nobody does: a check that takes nothing."""
    if not lock_path.is_file():
        return None
    with open(lock_path, "r") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return lock.read().strip() or "another kvbench process"
        fcntl.flock(lock, fcntl.LOCK_UN)
    return None


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write to a temp file, fsync it and rename it over `path`: readers never see half a file, a crash leaves the
    old or the new file whole, and a failed write (a full disk, an interrupt) removes its temp file; one left by a
    killed writer is removed when the run directory is next opened (`RunStore`)."""
    with full_disk_names(path), locked_temporary_file(path) as (tmp, f):  # `.<name>.tmp<pid>`, flock-ed while written
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        os.replace(tmp, path)


def write_text_atomic(path: Path, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def append_lines(path: Path, lines: list[str]) -> None:
    """Append whole lines and fsync: what is written is on disk before anything else happens."""
    with full_disk_names(path), open(path, "a", encoding="utf-8") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())


LINKED_FOLDERS = ("logs",)  # links kvbench makes itself (a job's stdout/stderr, kvbench/runs/cost.py), read only


def check_no_escape(run_dir: Path) -> None:
    """Refuse a run directory one of whose entries is a link leading outside it: kvbench would write through it
    (records appended to a file elsewhere, a manifest replaced elsewhere)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return
    home = run_dir.resolve()
    for entry in run_dir.iterdir():
        if entry.is_symlink() and entry.name not in LINKED_FOLDERS and not entry.resolve().is_relative_to(home):
            raise UnsafeRunDir(f"{entry} is a link to {entry.resolve()}, outside the run directory; kvbench will "
                               "not write through it: replace it with the file itself")


def lock_name(shard=None) -> str:
    return f".lock.{shard.tag}" if shard is not None else ".lock"


def read_json(path: Path) -> dict | None:
    """A JSON file kvbench wrote (manifest.json), None if absent; one line naming it if it is damaged."""
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise DamagedFile(f"{path} is not valid JSON ({e}); restore it, or move it aside (mv {path.name} "
                          f"{path.name}.bad) and rerun: the run writes a new one (earlier sessions' cost is then "
                          "lost) and keeps every finished sample") from None


def write_json_atomic(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def repair(path: Path) -> list:
    """The valid lines of a predictions file (kvbench.report.records.Line), after repairing it in place. A torn
    last line is cut off; any other invalid line is moved, with its line number and why, into
    `<predictions>.quarantine.jsonl` and the file is rewritten (atomically) with every valid line byte for byte, so
    no valid record after a damaged line is ever dropped (docs/records.md). The caller holds the file's lock."""
    if not path.exists():
        return []
    lines = scan(path.read_bytes())
    torn = [line for line in lines if line.torn]
    damaged = [line for line in lines if line.problem and not line.torn]
    if torn:
        logger.warning("%s: cutting off a torn last line %d (%s; crash mid-write?); its sample runs again",
                       path, torn[0].number, torn[0].problem)
    if damaged:
        quarantine = path.with_name(path.stem + ".quarantine.jsonl")
        when = datetime.now(timezone.utc).isoformat(timespec="seconds")
        append_lines(quarantine, [json.dumps({"file": path.name, "line": x.number, "problem": x.problem,
                                              "text": x.raw.decode("utf-8", "replace").rstrip("\n"),
                                              "quarantined_utc": when}, ensure_ascii=False) + "\n"
                                  for x in damaged])
        logger.warning("%s: set aside %d invalid line(s) (line %s: %s) into %s; every valid record is kept and "
                       "those samples run again", path, len(damaged), ", ".join(str(x.number) for x in damaged),
                       damaged[0].problem, quarantine.name)
        write_bytes_atomic(path, b"".join(line.raw for line in lines if line.record is not None))
    elif torn:  # the last line only: cut it off in place
        with open(path, "r+b") as f:
            f.truncate(torn[0].offset)
    return [line for line in lines if line.record is not None]


def predicted_ids(path: Path) -> set[str]:
    """Ids with a prediction in a predictions file as it is now (read only; a torn or invalid line is not counted):
    a shard skips the samples its run directory's merged predictions.jsonl already holds."""
    if not path.is_file():
        return set()
    return {line.record["id"] for line in scan(path.read_bytes())
            if line.record is not None and not is_failure(line.record)}


class RunStore:
    """Owns one run directory (or, with `shard`, one shard's file in it). Use `done_ids()` to resume, `append()` per
    sample, `write_scores()` at the end. The lock file names the holder's host and pid (what a cluster user kills)."""

    def __init__(self, run_dir: str | Path, shard=None):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        check_no_escape(self.dir)
        # two processes appending to one predictions.jsonl would duplicate ids
        self._lock = hold(self.dir / lock_name(shard), f"{self.dir} ({shard.tag})" if shard is not None else
                          str(self.dir))
        self.predictions_path = self.dir / (shard.predictions_name if shard is not None else PREDICTIONS)
        self._fd: int | None = None
        try:
            remove_dead_temporaries(self.dir, prefix=".")  # `.manifest.json.tmp<pid>` of a writer killed mid-write
            self._records = self._load_and_repair()
            if shard is not None:  # its file names the split for merge, even when it runs nothing (all merged)
                self.predictions_path.touch()
        except BaseException:
            self.close()
            raise

    def _load_and_repair(self) -> list[dict]:
        return [line.record for line in repair(self.predictions_path)]

    @property
    def records(self) -> list[dict]:
        return list(self._records)

    def done_ids(self, include_failed: bool = False) -> set[str]:
        """Ids whose latest record is a prediction (plus those that failed, if `include_failed`): resume skips them."""
        return {r["id"] for r in latest_per_id(self._records) if include_failed or not is_failure(r)}

    def append(self, record: dict) -> None:
        """Write one record and fsync it. A record that a reader would not accept (a bug in the code that made it)
        is written as that sample's failure record instead, so the run goes on and the sample is retried."""
        problem = record_problem(record)
        if problem is not None:
            from kvbench.runs.failures import failure_record

            logger.error("%s: record of %r is invalid (%s); recorded as a failure", self.predictions_path,
                         record.get("id"), problem)
            record = failure_record(SimpleNamespace(id=str(record.get("id")), meta={}),
                                    ValueError(f"invalid record: {problem}"))
        if self._fd is None:
            self._fd = os.open(self.predictions_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        data = (json.dumps(record, ensure_ascii=False, default=float) + "\n").encode("utf-8")
        at = os.lseek(self._fd, 0, os.SEEK_END)
        with full_disk_names(self.predictions_path):
            try:
                while data:
                    data = data[os.write(self._fd, data):]
                os.fsync(self._fd)
            except OSError:  # a full disk: leave no half line behind, the file stays as it was
                os.ftruncate(self._fd, at)
                raise
        self._records.append(record)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if not self._lock.closed:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()

    def write_json(self, name: str, obj: Any) -> None:
        write_json_atomic(self.dir / name, obj)

    def write_text(self, name: str, text: str) -> None:
        """Atomic, like `write_json`: shards of one run rewrite config.yaml side by side."""
        write_text_atomic(self.dir / name, text)

    def read_json(self, name: str) -> dict | None:
        return read_json(self.dir / name)

    def records_on_disk(self) -> list[dict]:
        """The valid records of the predictions file as it is now: what scores.json is computed from."""
        return [line.record for line in scan(self.predictions_path.read_bytes()) if line.record is not None] \
            if self.predictions_path.exists() else []


def aggregate(records: Iterable[dict], corpus_metrics: dict | None = None) -> dict:
    """Means over samples of every metric and of the accounting fields (the body of scores.json).

    `stats` adds each metric's standard error and n (kvbench.metrics.stats.metric_stats), and the dataset's corpus-level
    metrics (not means over samples) with a seeded bootstrap se; `metrics` stays {metric: mean} for old readers.
    Failure records are left out of every mean and counted in `n_failed`: LongBench's eval.py scores whatever the
    prediction file holds, so a sample without a prediction is excluded, not scored 0 (`failures_counted_as`).
    """
    from kvbench.metrics.stats import metric_stats

    records = latest_per_id(records)
    failed = sorted(r["id"] for r in records if is_failure(r))
    records = [r for r in records if not is_failure(r)]
    if failed:
        return {**aggregate(records, corpus_metrics), "n_failed": len(failed), "failed_ids": failed}
    if not records:
        return {"n": 0, "n_failed": 0, "failures_counted_as": FAILURES_COUNTED_AS, "metrics": {}}
    records = [with_follow_up_work(r) for r in records]  # a sample asked twice: both requests' work

    def mean(key: str) -> float | None:  # None where a record lacks it (a server's replies hold no KV bytes)
        values = [r.get(key) for r in records]
        return None if any(v is None for v in values) else sum(values) / len(values)

    def metric_mean(m: str) -> float:  # over the records that have it (LooGLE: cloze and QA metrics differ)
        values = [r["scores"][m] for r in records if m in r.get("scores", {})]
        return sum(values) / len(values)

    metrics = sorted({m for r in records for m in r.get("scores", {})})
    stats = metric_stats(records, corpus_metrics)
    full = mean("full_kv_bytes")
    return {
        "n": len(records), "n_failed": 0, "failures_counted_as": FAILURES_COUNTED_AS,
        "metrics": {m: metric_mean(m) for m in metrics}
        | {m: s["mean"] for m, s in stats.items() if m not in metrics},
        "stats": stats,
        "kv_bytes_mean": mean("kv_bytes"),
        "full_kv_bytes_mean": full,
        "kv_ratio": mean("kv_bytes") / full if full and mean("kv_bytes") is not None else None,
        "effective_budget_mean": mean("effective_budget"),
        "prefill_s_mean": mean("prefill_s"),
        "decode_tok_s_mean": mean("decode_tok_s"),
        **served_means(records),
    }


def served_means(records: list[dict]) -> dict:
    """A run against a server (kvbench.runs.remote): the means of its requests' streaming timings, over the
    replies that have each (a one-token reply has no time per output token). Empty for an in-process run."""
    out = {}
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        values = [r[key] for r in records if r.get(key) is not None]
        if values and any("ttft_s" in r for r in records):
            out[f"{key}_mean"] = sum(values) / len(values)
    return out
