"""`python -m kvbench.merge <run dir>...`: put the shards of a run (`shard=i/n`) back together.

Checks that every shard finished and that every sample id of the run is present exactly once, then writes what an
unsharded run writes: predictions.jsonl, scores.json through the runner's own `write_scores` (so the numbers cannot
differ from an unsharded run's), manifest.json with each shard's cost, and the run report. The shard files stay
where they are, so a rerun of any shard still resumes. The last shard of a sweep to finish calls this itself, and
`python -m kvbench.report` calls it for any run whose shards changed since.

`limit` and `shard` do not change the run directory, so predictions.jsonl may already hold records (an unsharded
run, an earlier merge): the merge adds to it, never replaces it. Every valid line it held stays, byte for byte and
first; a shard's record is added (in the run's order) only for an id the file has no prediction for. When both hold a
prediction of an id, the one already in predictions.jsonl wins (DESIGN.md "Nothing lost": a flushed record is never
rewritten) and the shard's stays in its shard file. A damaged line there is set aside as a run sets it aside.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

from kvbench.report.records import is_failure
from kvbench.runs.cost import totals
from kvbench.runs.shard import SHARD_FILE, Shard, assign
from kvbench.runs.store import (PREDICTIONS, RunDirBusy, RunDirError, hold, lock_name, predicted_ids, read_json,
                                 repair, write_bytes_atomic, write_json_atomic)

logger = logging.getLogger(__name__)
SHARD_ONLY = ("shard", "sample_ids", "n_shard_samples", "dataset_skipped", "cost")


class MergeError(ValueError):
    """A run's shards cannot be merged (missing, unfinished, inconsistent); the message is one line."""


@dataclass
class ShardState:
    shard: Shard
    records: list[dict]
    manifest: dict | None

    def covered(self, merged: set[str]) -> int:
        """Its samples with a record here or, skipped when it ran, a prediction in the merged predictions.jsonl."""
        ids = {r["id"] for r in self.records}
        owned = self.shard.select((self.manifest or {}).get("sample_ids", []), key=lambda i: i)
        return len(ids) + len(set(owned) & merged - ids)

    def finished(self, merged: set[str]) -> bool:
        m = self.manifest
        return bool(m and m.get("finished_utc") and self.covered(merged) >= m.get("n_shard_samples", 0))


def shard_count(run_dir: Path) -> int | None:
    """n of the run's `predictions.shard-<i>-of-<n>.jsonl` files; None if it has none."""
    counts = {int(m.group(2)) for p in Path(run_dir).iterdir() if (m := SHARD_FILE.match(p.name))}
    if len(counts) > 1:
        raise MergeError(f"merge: {run_dir} holds shards of different splits (of {', '.join(map(str, sorted(counts)))})"
                         f"; keep one split's files and rerun its shards")
    return counts.pop() if counts else None


def read_shards(run_dir: Path, count: int) -> list[ShardState]:
    from kvbench.report.runs import read_predictions
    from kvbench.runs.store import latest_per_id

    states = []
    for i in range(count):
        shard = Shard(i, count)
        path, mpath = run_dir / shard.predictions_name, run_dir / shard.manifest_name
        records = latest_per_id(read_predictions(path)) if path.is_file() else []  # a retry replaces its failure
        manifest = read_json(mpath)
        states.append(ShardState(shard, records, manifest))
    return states


def check_complete(run_dir: Path, states: list[ShardState], merged: set[str]) -> None:
    """One line naming every shard that is missing or unfinished, with the command that finishes it. `merged`: ids
    predicted in the run directory's predictions.jsonl (a shard skips them)."""
    bad = []
    for s in states:
        if s.manifest is None:
            bad.append(f"{s.shard.tag} missing (never started)")
        elif not s.finished(merged):
            bad.append(f"{s.shard.tag} unfinished ({s.covered(merged)}/{s.manifest.get('n_shard_samples', '?')} "
                       "samples)")
    if bad:
        redo = ",".join(f"{s.shard.index}/{s.shard.count}" for s in states if not s.finished(merged))
        raise MergeError(f"merge: {run_dir}: {'; '.join(bad)}; run (or rerun, it resumes) shard={redo}")


def ordered_records(run_dir: Path, states: list[ShardState], merged: set[str]) -> tuple[list[str], list[dict]]:
    """The run's ids, and the shards' records in that order: every id exactly once, in the shard that owns it or
    (skipped by it) predicted in `merged`, the run directory's predictions.jsonl."""
    ids = states[0].manifest["sample_ids"]
    for s in states[1:]:
        if s.manifest["sample_ids"] != ids or s.manifest.get("data_sha256") != states[0].manifest.get("data_sha256"):
            raise MergeError(f"merge: {run_dir}: {s.shard.tag} ran on different samples than {states[0].shard.tag} "
                             f"(data or limit changed between shards); rerun that shard's file from scratch")
    owner = {i: k for k, part in enumerate(assign(ids, len(states))) for i in part}
    by_id: dict[str, dict] = {}
    for s in states:
        for r in s.records:
            if r["id"] in by_id:
                raise MergeError(f"merge: {run_dir}: sample {r['id']!r} appears twice "
                                 f"({s.shard.tag} and another shard)")
            if owner.get(r["id"]) != s.shard.index:
                raise MergeError(f"merge: {run_dir}: sample {r['id']!r} in {s.shard.tag} does not belong to it")
            by_id[r["id"]] = r
    missing = [i for i in ids if i not in by_id and i not in merged]
    if missing:
        raise MergeError(f"merge: {run_dir}: {len(missing)} sample(s) missing, e.g. {missing[0]!r} "
                         f"(shard {owner[missing[0]]}/{len(states)})")
    return ids, [by_id[i] for i in ids if i in by_id]


def merged_manifest(states: list[ShardState], n_samples: int, old: dict | None = None) -> dict:
    """manifest.json of the merged run: the shards' common fields, their sessions' cost, and the sessions an earlier
    manifest.json of the directory recorded that are no shard's (an unsharded run into the same folder)."""
    base = {k: v for k, v in states[0].manifest.items() if k not in SHARD_ONLY}
    sessions = [x for s in states for x in s.manifest.get("cost", {}).get("sessions", [])]
    seen = {session_key(x) for x in sessions}
    earlier = ((old or {}).get("cost") or {}).get("sessions", []) if isinstance(old, dict) else []
    sessions = [x for x in earlier if isinstance(x, dict) and session_key(x) not in seen] + sessions
    cost = totals(sessions)
    shards = {s.shard.tag: {"n_samples": len(s.records), "started_utc": s.manifest.get("started_utc"),
                            "finished_utc": s.manifest.get("finished_utc"),
                            **{k: v for k, v in s.manifest.get("cost", {}).items() if k != "sessions"}}
              for s in states}
    return {**base, "n_samples": n_samples, "started_utc": min(s.manifest["started_utc"] for s in states),
            "finished_utc": max(s.manifest["finished_utc"] for s in states), "wall_s": cost["wall_s"],
            "shards": shards, "cost": cost}


def session_key(session: dict) -> tuple:
    return session.get("host"), session.get("started_utc"), session.get("job_id")


def union(held: list[dict], shard_records: list[dict]) -> list[dict]:
    """The shard records (one per id, in the run's order) that predictions.jsonl, holding `held`, lacks: an id with a
    prediction there keeps it; an id with only a failure there takes the shard's prediction (a retry)."""
    predicted = {r["id"] for r in held if not is_failure(r)}
    present = {r["id"] for r in held}
    return [r for r in shard_records if r["id"] not in predicted and not (is_failure(r) and r["id"] in present)]


@contextlib.contextmanager
def holding_run_dir(run_dir: Path) -> Iterator[None]:
    """The run directory's own lock, held while merging: an unsharded run writing into the same directory would
    otherwise append to the predictions.jsonl that merge replaces, and overwrite the merged scores and manifest."""
    try:
        lock = hold(run_dir / lock_name(), str(run_dir))
    except RunDirBusy as e:
        raise MergeError(f"merge: {run_dir} is in use ({e.holder}); merge when that run has finished: "
                         f"python -m kvbench.merge {run_dir}") from None
    try:
        yield
    finally:
        lock.close()


@contextlib.contextmanager
def merging_after_others(lock) -> Iterator[None]:
    """Two shards finishing together merge one after the other: the merge lock is taken (waiting) before the run
    directory's, which a merge in progress holds and which is refused, not waited for."""
    fcntl.flock(lock, fcntl.LOCK_EX)
    yield


def merge(run_dir: str | Path) -> dict:
    """Merge the run's shards (raises MergeError in one line if it cannot); returns scores.json's content."""
    from kvbench.runs.config import load_yaml, setup
    from kvbench.runs.records import write_scores

    run_dir = Path(run_dir)
    count = shard_count(run_dir)
    if count is None:
        raise MergeError(f"merge: {run_dir} has no predictions.shard-<i>-of-<n>.jsonl files (not a sharded run)")
    with open(run_dir / ".lock.merge", "a") as lock, merging_after_others(lock), holding_run_dir(run_dir):
        states = read_shards(run_dir, count)
        held = repair(run_dir / PREDICTIONS)  # what the directory already holds: kept, first, byte for byte
        merged = {line.record["id"] for line in held if not is_failure(line.record)}
        check_complete(run_dir, states, merged)
        ids, records = ordered_records(run_dir, states, merged)
        cfg = load_yaml(run_dir / "config.yaml")
        _, dataset, spec = setup(cfg)
        if hasattr(dataset, "skipped"):  # state the dataset gathered while building (RULER's skipped tasks)
            dataset.skipped = dict(states[0].manifest.get("dataset_skipped") or {})
        old = read_json(run_dir / "manifest.json")  # a damaged one stops here, in one line
        added = union([line.record for line in held], records)
        write_bytes_atomic(run_dir / PREDICTIONS, b"".join(line.raw for line in held) + "".join(
            json.dumps(r, ensure_ascii=False, default=float) + "\n" for r in added).encode("utf-8"))
        if held and added:
            logger.info("merge: %s already held %d records; added %d from the shards", run_dir, len(held),
                        len(added))
        manifest = merged_manifest(states, len(ids), old)
        summary = write_scores(run_dir, [line.record for line in held] + added,
                               [SimpleNamespace(id=i) for i in ids], dataset, manifest["dataset"], manifest["method"],
                               cfg, spec)
        write_json_atomic(run_dir / "manifest.json", manifest)
    if cfg.get("report", False):
        try:
            from kvbench.report import write_run_report

            write_run_report(run_dir)
        except Exception as e:  # a plotting problem must never cost the merge
            logger.warning("report for %s failed: %s", run_dir, e)
    logger.info("merged %d shards of %s: %d samples, %s = %.4f", count, run_dir, len(ids), dataset.primary_metric,
                summary["metrics"].get(dataset.primary_metric, float("nan")))
    return summary


def merge_when_complete(run_dir: str | Path) -> dict | None:
    """What a shard calls when it finishes: merge if every shard has finished, else say who is still running."""
    try:
        states = read_shards(Path(run_dir), shard_count(Path(run_dir)) or 0)
        check_complete(Path(run_dir), states, predicted_ids(Path(run_dir) / PREDICTIONS))
    except MergeError as e:
        logger.info("not merging yet: %s", e)
        return None
    return merge(run_dir)


def stale(run_dir: Path) -> bool:
    """A sharded run whose merged predictions.jsonl is absent or older than one of its shard files, or whose merge
    stopped between its writes (predictions.jsonl, then scores.json, then manifest.json: either is absent or older)."""
    shard_files = [p for p in run_dir.iterdir() if SHARD_FILE.match(p.name)]
    merged = run_dir / PREDICTIONS
    if not shard_files:
        return False
    if not merged.is_file() or merged.stat().st_mtime < max(p.stat().st_mtime for p in shard_files):
        return True
    after = [run_dir / "scores.json", run_dir / "manifest.json"]
    return any(not p.is_file() or p.stat().st_mtime < merged.stat().st_mtime for p in after)


def sharded_run_dirs(path: Path) -> list[Path]:
    path = Path(path)
    if not path.is_dir():
        return []
    return sorted({p.parent for p in path.rglob("predictions.shard-*-of-*.jsonl") if SHARD_FILE.match(p.name)})


def merge_stale(paths) -> None:
    """For the report: merge every sharded run under `paths` whose shards changed; warn (one line) and skip a run
    that cannot be merged yet."""
    for path in paths:
        for run_dir in sharded_run_dirs(Path(path)):
            if stale(run_dir):
                try:
                    merge(run_dir)
                except (MergeError, RunDirError, ValueError) as e:  # (a config or record that fails its check)
                    logger.warning("%s", str(e).splitlines()[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbench.merge", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="sharded run directories, or folders searched for them")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    failed = 0
    for path in args.paths:
        run_dirs = sharded_run_dirs(Path(path)) if Path(path).is_dir() else []
        if not run_dirs:
            print(f"kvbench: merge: no sharded run (predictions.shard-<i>-of-<n>.jsonl) under {path}", file=sys.stderr)
            failed += 1
        for run_dir in run_dirs:
            try:
                summary = merge(run_dir)
            except (MergeError, RunDirError, ValueError, FileNotFoundError) as e:
                print(f"kvbench: {str(e).splitlines()[0]}", file=sys.stderr)
                failed += 1
                continue
            print(f"merged {run_dir}: {summary['n']} samples -> scores.json")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
