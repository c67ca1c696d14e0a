"""Property test (issue 42, "Done when"): random sequences of run, shard, `limit`, merge, crash + resume, rerun with
other settings and report into one results_dir, on the tiny model. After every step: every valid record a
predictions file held is still there byte for byte, a successful merge holds every shard's prediction, and the
summary table has one row per run directory whose n and score are that directory's own (never two runs mixed).
The sequences are drawn from fixed seeds, so a failure names a sequence that replays."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvbench.report import load_runs, summary_table
from kvbench.report.__main__ import main as report_main
from kvbench.report.records import latest_per_id, scan
from kvbench.runs.merge import MergeError, merge, sharded_run_dirs
from kvbench.runs.store import RunDirError
from tests.unit.test_cli import run_here

BASE = ["model=tiny_llama", "method=snapkv", "budget=64", "dataset.metrics=[pyramidkv_recall]", "report=false"]
SETTINGS = {"A": ["dataset.context_lengths=[300,400]", "dataset.depth_percents=[0,100]"],  # 4 samples
            "B": ["dataset.context_lengths=[300]", "dataset.depth_percents=[0,50]"]}        # 2 samples


def valid_lines(results: Path) -> dict[Path, list[bytes]]:
    """Every predictions file under `results` (merged and shard files) -> its valid lines, as bytes."""
    return {p: [line.raw for line in scan(p.read_bytes()) if line.record is not None]
            for p in results.rglob("predictions*.jsonl") if "quarantine" not in p.name}


def own_rows(results: Path) -> list[tuple[int, float]]:
    """Each run directory's (n, 100 x mean score), from its predictions.jsonl alone: the rows a report must show."""
    rows = []
    for p in results.rglob("predictions.jsonl"):
        records = latest_per_id(line.record for line in scan(p.read_bytes()) if line.record is not None)
        assert not any(r.get("failed") for r in records), p
        if records:
            rows.append((len(records), 100 * sum(r["score"] for r in records) / len(records)))
    return sorted(rows)


class Sequence:
    """One random sequence of commands into one results_dir, and the checks after each."""

    def __init__(self, results: Path, out: Path, seed: int):
        self.results, self.out, self.rng, self.log = results, out, random.Random(seed), []

    def refused(self, step: str, e: Exception) -> None:
        """A refusal is allowed (shards of another limit, say) if it is one line; it must lose nothing either."""
        assert "\n" not in str(e), f"{self.log}: {step}: {e}"
        self.log.append(f"{step} -> refused: {str(e)[:80]}")

    def run(self, *overrides: str, step: str) -> None:
        try:
            run_here(*BASE, *overrides, results=self.results)
            self.log.append(step)
        except (MergeError, RunDirError, ValueError) as e:
            self.refused(step, e)

    def step(self) -> None:
        rng, name = self.rng, self.rng.choice(sorted(SETTINGS))
        setting = SETTINGS[name]
        kind = rng.choice(["run", "run", "shards", "shards", "merge", "resume", "report"])
        if kind == "run":
            limit = rng.choice([None, 1, 3])
            self.run(*setting, *([f"limit={limit}"] if limit else []), step=f"run {name} limit={limit}")
        elif kind == "shards":
            limit, which = rng.choice([None, 2]), rng.choice([(0, 1), (1, 0), (0,)])
            for i in which:
                self.run(*setting, *([f"limit={limit}"] if limit else []), f"shard={i}/2",
                         step=f"shard {i}/2 {name} limit={limit}")
        elif kind == "merge":
            self.merge()
        elif kind == "resume":  # a run killed mid-write (a torn last line), then the same command again
            files = sorted(self.results.rglob("predictions.jsonl"))
            if files:
                with open(files[0], "ab") as f:
                    f.write(b'{"id": "niah-L300-d0", "predic')
            self.run(*setting, step=f"crash + resume {name}")
        else:
            self.report()

    def merge(self) -> None:
        """`kvbench.merge` of every sharded run; after each merge that succeeds, every shard's prediction is in
        predictions.jsonl."""
        for run_dir in sharded_run_dirs(self.results):
            try:
                merge(run_dir)
            except (MergeError, RunDirError, ValueError) as e:
                self.refused(f"merge {run_dir.name}", e)
                continue
            merged = {r["id"] for r in map(lambda x: x.record, scan((run_dir / "predictions.jsonl").read_bytes()))
                      if r is not None and not r.get("failed")}
            for shard in run_dir.glob("predictions.shard-*.jsonl"):
                ids = {x.record["id"] for x in scan(shard.read_bytes()) if x.record is not None}
                assert ids <= merged, f"{self.log}: merge lost {sorted(ids - merged)} of {shard.name}"
            self.log.append(f"merge {run_dir.name}")

    def report(self) -> None:
        if not any(self.results.rglob("predictions.jsonl")):
            return
        assert report_main([str(self.results), "--out", str(self.out)]) == 0, self.log
        self.log.append("report")

    def check(self, before: dict[Path, list[bytes]]) -> dict[Path, list[bytes]]:
        after = valid_lines(self.results)
        for path, lines in before.items():
            now = set(after.get(path, []))
            lost = [x for x in lines if x not in now]
            assert not lost, f"{self.log}: {path.name} of {path.parent.name} lost {len(lost)} record(s)"
        if any(self.results.rglob("predictions.jsonl")):
            table = summary_table(load_runs([self.results]))
            rows = sorted(zip(table["n"].astype(int), table["Acc."].astype(float)))
            expected = own_rows(self.results)
            assert [n for n, _ in rows] == [n for n, _ in expected], f"{self.log}: {rows} vs {expected}"
            assert [a for _, a in rows] == pytest.approx([a for _, a in expected]), f"{self.log}"
        return after


@pytest.mark.parametrize("seed", [0, 1])
def test_no_sequence_of_commands_loses_a_record_or_mixes_two_runs(tmp_path: Path, seed: int):
    seq = Sequence(tmp_path / "results", tmp_path / "report", seed)
    seen: dict[Path, list[bytes]] = {}
    for _ in range(6):
        seq.step()
        seen = seq.check(seen)
    seq.merge()
    seq.report()
    seq.check(seen)
