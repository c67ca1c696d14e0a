"""Read run directories (docs/records.md) into one pandas table, one row per prediction record.

The report works from records only (never from a live model), so any set of runs, finished or crashed halfway, from
one machine or a cluster, can be compared. A run directory is any folder holding predictions.jsonl; its
manifest.json says which model, method, budget and dataset produced the records.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterable

import pandas as pd

from kvbench.report.bits import kept_entries, run_bits
from kvbench.report.records import is_failure, latest_per_id, scan, with_follow_up_work
from kvbench.report.settings import ROW_KEYS, SETTING, setting_labels

logger = logging.getLogger(__name__)

PREDICTIONS = "predictions.jsonl"
MANIFEST = "manifest.json"
# manifest fields copied onto every record row; run_dir is added as well
MANIFEST_COLUMNS = ("model", "dataset", "method", "budget", "ratio", "primary_metric", "dataset_version", "query")


def find_run_dirs(paths: Iterable[str | Path]) -> list[Path]:
    """Each path is a run directory or a folder searched recursively for them; returns them sorted, deduplicated."""
    paths = list(paths)
    if not paths:
        raise ValueError("report: no paths given; pass run directories or folders that contain them")
    found: set[Path] = set()
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"report: {p} does not exist")
        if (p / PREDICTIONS).is_file():
            here = {p.resolve()}
        else:
            here = {f.parent.resolve() for f in p.rglob(PREDICTIONS) if f.is_file()} if p.is_dir() else set()
        if not here:
            raise ValueError(f"report: no run directory (a folder with {PREDICTIONS}) found under {p}")
        found |= here
    return sorted(found)


def read_predictions(path: str | Path) -> list[dict]:
    """The records of a predictions.jsonl (kvbench.report.records judges each line). A torn last line (a crash
    mid-write) is skipped with a warning; any other invalid line raises one line naming it: the report never drops
    records silently, and rerunning the run's command sets such lines aside (docs/records.md)."""
    path = Path(path)
    records = []
    for line in scan(path.read_bytes()):
        if line.torn:
            logger.warning("report: %s:%d: skipping a torn last line (%s)", path, line.number, line.problem)
        elif line.problem:
            raise DamagedRecords(f"report: {path}:{line.number} is not a valid record ({line.problem}); rerun the "
                                 "run's command to set it aside (it keeps every valid record), or repair that line")
        else:
            records.append(line.record)
    return records


class DamagedRecords(ValueError):
    """A predictions file with an invalid line before its last: the report leaves that run out, naming it."""


class ManifestError(ValueError):
    """A manifest.json that is there but cannot be read (not JSON, not an object): unlike a folder without runs, a
    damaged run, so even `--paper` (which shows a table whatever runs exist) stops on it."""


def read_manifest(run_dir: str | Path) -> dict:
    """The run's manifest.json; a run directory without one is not a kvbench run, so this raises, and a damaged one
    (truncated, hand-edited) raises a one-line ManifestError naming the file, where and how to repair it."""
    path = Path(run_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"report: {run_dir} has {PREDICTIONS} but no {MANIFEST}; not a kvbench run directory")
    fix = (f"restore it, or delete it and rerun the run's command (it resumes from {PREDICTIONS} and writes a new "
           "manifest; the cost of earlier sessions is lost)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ManifestError(f"report: {path} is not UTF-8 text (byte {e.start}); {fix}") from None
    except json.JSONDecodeError as e:
        raise ManifestError(f"report: {path} is not valid JSON (line {e.lineno} column {e.colno}: {e.msg}); "
                            f"{fix}") from None
    if not isinstance(manifest, dict):
        raise ManifestError(f"report: {path} holds a JSON {type(manifest).__name__}, not an object; {fix}")
    problem = manifest_problem(manifest)
    if problem is not None:
        raise ManifestError(f"report: {path} is not a kvbench manifest ({problem}); {fix}")
    return manifest


# what every row of the report takes from the manifest: names (required, non-empty strings), and optional fields
# (field -> what it must be, its check)
NAMES = ("method", "dataset", "model")


def _optional(types: tuple):
    return lambda v: v is None or (isinstance(v, types) and not isinstance(v, bool))


OPTIONAL = {"budget": ("an integer or null", _optional((int,))), "ratio": ("a number or null", _optional((int, float))),
            "primary_metric": ("a string or null", _optional((str,))), "query": ("a string or null", _optional((str,))),
            "dataset_version": ("a string, a number or null", _optional((str, int, float)))}


def manifest_problem(manifest: dict) -> str | None:
    """Why a manifest (a JSON object) cannot describe a run's rows, in a few words; None if it can."""
    for key in NAMES:
        value = manifest.get(key)
        if not isinstance(value, str) or not value:
            return f"'{key}' is {json.dumps(value)[:40] if key in manifest else 'missing'}, not a name"
    for key, (what, ok) in OPTIONAL.items():
        if not ok(manifest.get(key)):
            return f"'{key}' is {json.dumps(manifest[key])[:40]}, not {what}"
    return None


def load_run(run_dir: str | Path) -> pd.DataFrame:
    """One run's records, nested dicts flattened (`meta.context_length`, `scores.<metric>`), manifest columns added."""
    run_dir = Path(run_dir)
    manifest = read_manifest(run_dir)
    records = latest_per_id(read_predictions(run_dir / PREDICTIONS))
    failed = [r["id"] for r in records if is_failure(r)]
    if failed:  # excluded from every mean, as in scores.json (kvbench.runs.store.aggregate)
        logger.warning("report: %s: %d failed samples excluded (%s)", run_dir, len(failed), ", ".join(failed[:5]))
        records = [r for r in records if not is_failure(r)]
    if not records:
        logger.warning("report: %s has no complete prediction records yet", run_dir)
    records = [with_follow_up_work(r) for r in records]  # a sample asked twice: both requests' work (records.py)
    df = pd.json_normalize(records, sep=".") if records else pd.DataFrame()
    for col in MANIFEST_COLUMNS:
        df[col] = manifest.get(col)
    df["query"] = manifest.get("query") or "aware"  # runs from before `query` existed were question-aware
    df["run_dir"] = str(run_dir)
    df["bits"] = run_bits(run_dir)  # the memory axis (kvbench.report.bits)
    if "kept_per_head" in df:
        df["kv_entries"] = df["kept_per_head"].map(kept_entries)
    return df


def load_runs(paths: Iterable[str | Path]) -> pd.DataFrame:
    """All records of every run found under `paths`, as one DataFrame (one row per prediction record).

    Columns: the record fields of docs/records.md (nested `meta` and `scores` flattened with a dot), plus the
    manifest's model, dataset, method, budget, ratio, primary_metric, dataset_version, query (aware | agnostic),
    and run_dir.
    `budget` is a nullable integer: a full-cache or ratio-based run may have none. `setting` says what tells a run
    apart from the other runs of its row key (kvbench.report.settings; None where it is alone): tables key rows by it.
    """
    frames, damaged = [], []
    for run_dir in find_run_dirs(paths):
        try:
            frames.append(load_run(run_dir))
        except DamagedRecords as e:  # one damaged run does not stop the report of the others
            logger.warning("report: left out %s, the rest is reported: %s", run_dir, str(e).removeprefix("report: "))
            damaged.append(e)
    if damaged and not frames:
        raise damaged[0]
    frames = [f for f in frames if len(f)]
    if not frames:
        return pd.DataFrame(columns=[*MANIFEST_COLUMNS, "run_dir", "id", "score"])
    labels = setting_labels({f["run_dir"].iloc[0]: tuple(f[k].iloc[0] for k in ROW_KEYS) for f in frames})
    for f in frames:
        f[SETTING] = labels[f["run_dir"].iloc[0]]
    df = pd.concat(frames, ignore_index=True)
    df["budget"] = pd.to_numeric(df["budget"]).astype("Int64")
    df["ratio"] = pd.to_numeric(df["ratio"]).astype("Float64")
    return df
