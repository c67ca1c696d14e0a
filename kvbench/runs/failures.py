"""One failing sample must not stop a week-long sweep: per-sample failure records, and clean stops on a signal.

`attempt(sample, make_record)` runs one sample; if it raises (any Python exception; a CUDA out-of-memory error after
the cached blocks are freed), it returns a failure record instead, which goes into predictions.jsonl like a
prediction, so the failure is visible where the results are:

    {"id": ..., "failed": true, "error_type": "OutOfMemoryError", "error": "<first line of the message>",
     "where": "kvbench/engine/generation.py:123 in decode", "prompt_tokens": ..., "budget": ..., "meta": {...}}

Failed samples are excluded from every mean and counted in `n_failed` (kvbench.runs.store.aggregate). A rerun of the same
command retries them (`retry_failed=false` keeps them as they are); the retry's record supersedes the failure.

`stop_on_signals()` turns SIGTERM (what SLURM sends before a kill) into the same clean stop as Ctrl-C: every record
written so far is already flushed and fsynced, the run directory lock is released, and the rerun resumes.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import signal
import threading
import traceback
from pathlib import Path
from typing import Callable, Iterator

logger = logging.getLogger(__name__)

PACKAGE_ROOT = Path(__file__).resolve().parents[2]
NOTHING_SUCCEEDED: list[str] = []  # runs of this process in which every sample failed: the command exits 1


class Stopped(KeyboardInterrupt):
    """The run was asked to stop by a signal (SIGTERM); like Ctrl-C it is not a sample failure."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def where(exc: BaseException) -> str:
    """`file:line in function` of the innermost frame inside kvbench (else the innermost frame): where it failed."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"
    ours = [f for f in frames if Path(f.filename).resolve().is_relative_to(PACKAGE_ROOT / "kvbench")]
    frame = (ours or frames)[-1]
    path = Path(frame.filename).resolve()
    shown = path.relative_to(PACKAGE_ROOT) if path.is_relative_to(PACKAGE_ROOT) else path.name
    return f"{shown}:{frame.lineno} in {frame.name}"


def one_line(exc: BaseException, limit: int = 500) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:limit]


def free_accelerator_memory() -> None:
    """After an out-of-memory error: drop the failed sample's tensors and return cached blocks to the driver."""
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def failure_record(sample, exc: BaseException, **context) -> dict:
    return {"id": sample.id, "failed": True, "error_type": type(exc).__name__, "error": one_line(exc),
            "where": where(exc), **context, "meta": sample.meta}


def note_if_nothing_succeeded(run_dir: Path, records: list[dict], summary: dict) -> None:
    """A run whose samples all failed (a method's bug, a model that cannot run) is not a result: log the first
    failure's cause and remember it, so the command ends with exit code 1 and that line."""
    if summary["n"] > 0 or not summary["n_failed"]:
        return
    first = next(r for r in records if r["id"] in summary["failed_ids"] and r.get("failed") is True)
    line = (f"no sample of {run_dir} succeeded ({summary['n_failed']} failed); the first: {first['error_type']}: "
            f"{first['error']} at {first.get('where')}")
    logger.error("%s", line)
    NOTHING_SUCCEEDED.append(line)


def attempt(sample, make_record: Callable[[], dict], context: dict | None = None,
            on_failure: Callable[[], None] | None = None) -> dict:
    """`make_record()`, or a failure record if it raises an Exception (signals and Ctrl-C pass through).
    `context` (e.g. prompt_tokens, budget) may be filled in by `make_record` as it goes; it goes into the record.
    `on_failure` drops what the failed sample left behind (e.g. the capture's reference to its KV cache)."""
    import torch

    try:
        return make_record()
    except Exception as exc:  # noqa: BLE001 - any per-sample error becomes a record; the run goes on
        record = failure_record(sample, exc, **(context or {}))
        out_of_memory = isinstance(exc, torch.cuda.OutOfMemoryError)
    if on_failure is not None:
        on_failure()
    if out_of_memory:  # outside the except block, so the traceback (and the tensors its frames hold) is gone
        free_accelerator_memory()
    logger.warning("sample %s failed: %s: %s (at %s); recorded in predictions.jsonl, a rerun retries it",
                   sample.id, record["error_type"], record["error"], record["where"])
    return record


def fail_remaining(jobs, written_ids: set[str], exc: BaseException) -> list[dict]:
    """Failure records for the samples of a decoding batch that raised before they were written (one error stops
    every sample decoded with it); `jobs` are (sample, ids, budget, ...)."""
    records = [failure_record(s, exc, prompt_tokens=len(ids), budget=budget)
               for s, ids, budget, *_ in jobs if s.id not in written_ids]
    logger.warning("batched decoding failed: %s: %s (at %s); %d unfinished samples recorded as failed, a rerun "
                   "retries them", type(exc).__name__, one_line(exc), where(exc), len(records))
    free_accelerator_memory()
    return records


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Inside: SIGTERM raises `Stopped` (a KeyboardInterrupt) in the main thread, like Ctrl-C, instead of killing
    the process mid-step; the previous handler is restored on exit. A no-op outside the main thread, and where
    someone else already handles SIGTERM (submitit's requeue logic ignores it on purpose)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) not in (
            signal.SIG_DFL, None):  # a launcher's own handler (submitit requeues on SIGUSR2, bypasses SIGTERM) stays
        yield
        return

    def handler(signum, frame):
        raise Stopped(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
