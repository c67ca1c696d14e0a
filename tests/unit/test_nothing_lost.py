"""Nothing lost, ever (docs/records.md): damaged files, a merge beside a live run, a full disk, links out of the run
directory, a run in which every sample failed; each as a user meets it, on the tiny random model."""
from __future__ import annotations

import fcntl
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvbench.report.records import record_problem, scan
from kvbench.report.runs import read_predictions
from kvbench.runs.merge import MergeError, holding_run_dir, merge
from kvbench.runs.merge import main as merge_main
from kvbench.runs.store import DamagedFile, RunDirBusy, RunStore, UnsafeRunDir
from tests.unit.test_cli import ENV, ROOT, records, run_dirs, run_here
from tests.unit.test_store import rec

NEEDLE = ["model=tiny_llama", "method=snapkv", "budget=64", "dataset.context_lengths=[300,400]",
          "dataset.depth_percents=[0,100]", "dataset.metrics=[pyramidkv_recall]"]
TIMINGS = {"prefill_s", "compress_s", "decode_s", "decode_tok_s", "e2e_s", "peak_mem_bytes"}


def without_timings(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in records]


# --- which lines are records ----------------------------------------------------------------------------------
@pytest.mark.parametrize("record,problem", [
    ({"id": "a", "score": 1.0, "scores": {"m": 1.0}}, None),
    ({"id": "a", "score": 1, "scores": {"m": 0}, "budget": None, "prediction": ""}, None),
    ({"id": "a", "failed": True, "error_type": "ValueError", "error": "x", "where": None}, None),
    ({"id": "a", "score": "high", "scores": {"m": 1.0}}, "'score' is \"high\", not a number"),
    ({"id": "a", "score": 1.0, "scores": {"m": 1.0}, "prediction": 5}, "'prediction' is 5, not a string"),
    ({"id": "a", "score": True, "scores": {"m": 1.0}}, "'score' is true, not a number"),
    ({"id": "a", "score": 1.0, "scores": {"m": None}}, "scores['m'] is null, not a number"),
    ({"id": "a", "score": 1.0, "scores": {}, "new_tokens": 2.5}, "'new_tokens' is 2.5, not an integer"),
    ({"id": "a", "scores": {}}, "no 'score'"),
    ({"id": "a", "failed": True, "error": "x"}, "no 'error_type'"),
    ({"id": 7, "score": 1.0, "scores": {}}, "no string 'id'"),
    ({"note": "edited by hand"}, "no string 'id'"),
    ([1, 2], "not a JSON object but list"),
])
def test_a_record_is_judged_by_its_fields_types(record, problem):
    assert record_problem(record) == problem


def test_only_the_last_line_can_be_torn():
    good = json.dumps(rec(0)) + "\n"
    lines = scan((good + "garbage\n" + good + "\n" + '{"id": "s2", "sco').encode())
    assert [(x.number, x.torn, x.record is not None) for x in lines] == [(1, False, True), (2, False, False),
                                                                      (3, False, True), (5, True, False)]
    assert lines[3].offset == 2 * len(good) + len("garbage\n") + 1
    (last,) = scan((good + json.dumps(rec(1))).encode())[1:]  # whole JSON, but its newline never came
    assert last.torn and last.record is None


# --- a damaged line in the middle of predictions.jsonl ---------------------------------------------------------
@pytest.mark.parametrize("bad", ["garbage", '{"id": "s1", "score": "high", "scores": {"m": 1}}',
                                 '{"id": "s1", "score": 1, "scores": {"m": 1}, "prediction": 5}'])
def test_a_damaged_line_is_set_aside_and_every_valid_record_kept(tmp_path, bad):
    lines = [json.dumps(rec(0)) + "\n", bad + "\n", json.dumps(rec(2)) + "\n", json.dumps(rec(3)) + "\n"]
    (tmp_path / "predictions.jsonl").write_text("".join(lines))
    store = RunStore(tmp_path)
    assert store.done_ids() == {"s0", "s2", "s3"}
    store.close()
    # the valid lines stay byte for byte; the damaged one is in the quarantine file with its line number
    assert (tmp_path / "predictions.jsonl").read_text() == lines[0] + lines[2] + lines[3]
    (aside,) = map(json.loads, (tmp_path / "predictions.quarantine.jsonl").read_text().splitlines())
    assert aside["line"] == 2 and aside["text"] == bad and aside["file"] == "predictions.jsonl"
    RunStore(tmp_path).close()  # a clean file now: nothing more set aside
    assert len((tmp_path / "predictions.quarantine.jsonl").read_text().splitlines()) == 1
    with pytest.raises(ValueError, match=r"predictions.jsonl:2 is not a valid record .*rerun the run's command"):
        read_predictions(_damaged_copy(tmp_path, lines, bad))  # the report refuses, naming the line


def _damaged_copy(tmp_path: Path, lines: list[str], bad: str) -> Path:
    """The damaged file again, in a folder of its own: what the report reads before any run repaired it."""
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "predictions.jsonl").write_text(lines[0] + bad + "\n" + lines[2] + lines[3])
    return copy / "predictions.jsonl"


def test_a_rerun_after_damage_keeps_every_valid_record_and_predicts_as_before(tmp_path):
    """As a user meets it: a finished run, a line in the middle garbled (a bad sync, an editor), the same command
    again. Every valid record stays as it was, only the garbled sample runs again, and the predictions equal an
    undamaged run's."""
    run_dir = run_here(*NEEDLE, results=tmp_path)
    before = (run_dir / "predictions.jsonl").read_text().splitlines(keepends=True)
    assert len(before) == 4
    damaged = before[:1] + ['{"id": "niah-L300-d100", "prediction": "half a reco\x00rd",,\n'] + before[2:]
    (run_dir / "predictions.jsonl").write_text("".join(damaged))
    assert run_here(*NEEDLE, results=tmp_path) == run_dir
    after = (run_dir / "predictions.jsonl").read_text().splitlines(keepends=True)
    assert after[:3] == [before[0], before[2], before[3]]  # untouched, byte for byte, in their order
    assert without_timings(records(run_dir)) == without_timings([json.loads(x) for x in after[:3]] +
                                                                [json.loads(before[1])])
    assert json.loads((run_dir / "scores.json").read_text())["n"] == 4
    (aside,) = map(json.loads, (run_dir / "predictions.quarantine.jsonl").read_text().splitlines())
    assert aside["line"] == 2 and aside["text"] == damaged[1].rstrip("\n")


# --- merge beside a live run -----------------------------------------------------------------------------------
def test_merge_beside_a_live_run_refuses_and_the_run_scores_what_is_on_disk(tmp_path, capsys):
    """As a user meets it: two shards of a 2-sample run merged; then the same configuration unsharded on all four
    samples, a real process, held after its first new record; `python -m kvbench.merge` meanwhile refuses in one
    line and replaces nothing; the run then finishes with scores from the records on disk and the shards' cost."""
    release = tmp_path / "release"
    held = [*NEEDLE, "dataset._target_=tests.unit.faulty.HeldNeedle", f"+dataset.release={release}"]
    release.touch()  # the shards run straight through
    for i in range(2):
        run_dir = run_here(*held, "limit=2", f"shard={i}/2", results=tmp_path)  # the second one merges
    merged = (run_dir / "predictions.jsonl").read_bytes()
    assert len(records(run_dir)) == 2
    release.unlink()
    live = subprocess.Popen([sys.executable, "-m", "kvbench.run", *held, f"results_dir={tmp_path}"], cwd=ROOT,
                            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while len((run_dir / "predictions.jsonl").read_bytes().splitlines()) < 3:  # its first new record
            assert live.poll() is None, live.stderr.read()
            time.sleep(0.1)
        capsys.readouterr()
        assert merge_main([str(run_dir)]) == 1
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith(f"kvbench: merge: {run_dir} is in use (") and "pid " in line
        assert (run_dir / "predictions.jsonl").read_bytes().startswith(merged)  # nothing replaced
    finally:
        release.touch()
        assert live.wait() == 0, live.stderr.read()
    on_disk = records(run_dir)
    assert len(on_disk) == 4 and (run_dir / "predictions.jsonl").read_bytes().startswith(merged)
    scores = json.loads((run_dir / "scores.json").read_text())
    assert scores["n"] == 4
    assert scores["metrics"]["pyramidkv_recall"] == pytest.approx(sum(r["score"] for r in on_disk) / 4)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert set(manifest["shards"]) == {"shard-0-of-2", "shard-1-of-2"}  # what the shards cost is kept


def test_merge_takes_the_run_directory_lock(tmp_path):
    for i in range(2):
        run_dir = run_here(*NEEDLE, "limit=2", f"shard={i}/2", results=tmp_path)
    live = RunStore(run_dir)  # what a run holds while it writes into the directory
    try:
        with pytest.raises(MergeError, match=r"is in use \(\S+ pid \d+\); merge when that run has finished"):
            merge(run_dir)
    finally:
        live.close()
    with pytest.raises(RunDirBusy):  # and a run cannot start while a merge holds it
        with holding_run_dir(run_dir):
            RunStore(run_dir)


def test_two_shards_finishing_together_merge_one_after_the_other(tmp_path):
    """The last two shards of a run can finish at once and both call merge: the second waits for the first (which
    holds the merge lock and the run directory's) and then merges again, instead of failing its job because the
    directory is in use (seen under load in test_cluster's submitit sweep)."""
    for i in range(2):
        run_dir = run_here(*NEEDLE, "limit=2", f"shard={i}/2", results=tmp_path)
    outcome: list = []
    with open(run_dir / ".lock.merge", "a") as first:  # the first shard's merge, in progress
        fcntl.flock(first, fcntl.LOCK_EX)
        with holding_run_dir(run_dir):
            second = threading.Thread(target=lambda: outcome.append(catching(merge, run_dir)))
            second.start()
            second.join(timeout=1.0)
            assert second.is_alive() and not outcome  # waiting, not refused
        fcntl.flock(first, fcntl.LOCK_UN)
    second.join()
    (summary,) = outcome
    assert not isinstance(summary, Exception), summary
    assert summary["n"] == 2


def catching(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - the test reads it
        return e


# --- refused before weights load, in one line ------------------------------------------------------------------
def made_run_dir(tmp_path: Path) -> tuple[Path, Path]:
    results = tmp_path / "results"
    return results, run_here(*NEEDLE, "limit=1", results=results)


def test_a_second_run_in_a_busy_directory_is_refused_before_hydra_writes(tmp_path):
    results, run_dir = made_run_dir(tmp_path)
    hydra_before = sorted(run_dir.rglob("*"))
    live = RunStore(run_dir)
    try:
        with pytest.raises(SystemExit) as stop:
            from kvbench.runs.run import check_command_line

            check_command_line([*NEEDLE, f"results_dir={results}"])
        assert stop.value.code.startswith(f"kvbench: {run_dir} is in use by ") and "pid" in stop.value.code
    finally:
        live.close()
    assert sorted(run_dir.rglob("*")) == hydra_before


def test_a_shard_of_another_split_is_refused_before_it_runs(tmp_path):
    results = tmp_path / "results"
    run_dir = run_here(*NEEDLE, "shard=0/2", results=results)
    line = check_line(*NEEDLE, "shard=1/3", results=results)
    assert line == (f"kvbench: shard=1/3: {run_dir} already holds shards of 2 (predictions.shard-*-of-2.jsonl); "
                    "use shard=i/2, or move those files away")


def check_line(*args: str, results: Path) -> str:
    from kvbench.runs.run import check_command_line

    with pytest.raises(SystemExit) as stop:
        check_command_line([*args, f"results_dir={results}"])
    line = stop.value.code
    assert isinstance(line, str) and "\n" not in line, line
    return line


def test_a_damaged_manifest_is_named_in_one_line(tmp_path):
    results, run_dir = made_run_dir(tmp_path)
    (run_dir / "manifest.json").write_text('{"method": "snapkv", "bud')
    line = check_line(*NEEDLE, results=results)
    assert line.startswith(f"kvbench: {run_dir / 'manifest.json'} is not valid JSON (")
    assert "mv manifest.json manifest.json.bad" in line
    with pytest.raises(DamagedFile):  # the run itself (checks skipped): the same, before weights load
        run_here(*NEEDLE, results=results)


def test_a_link_out_of_the_run_directory_is_never_written_through(tmp_path):
    results, run_dir = made_run_dir(tmp_path)
    outside = tmp_path / "elsewhere.jsonl"
    shutil.move(run_dir / "predictions.jsonl", outside)
    (run_dir / "predictions.jsonl").symlink_to(outside)
    before = outside.read_bytes()
    line = check_line(*NEEDLE, results=results)
    assert line.startswith(f"kvbench: {run_dir / 'predictions.jsonl'} is a link to {outside}, outside the run")
    with pytest.raises(UnsafeRunDir):
        RunStore(run_dir)
    assert outside.read_bytes() == before


# --- a full disk ----------------------------------------------------------------------------------------------
FULL_DISK = r"""
set -u
d=$(mktemp -d) && mount -t tmpfs -o size=256k tmpfs "$d" || exit 77
trap 'umount "$d"' EXIT
{python} - "$d" <<'PY'
import json, os, sys
from pathlib import Path
from kvbench.runs.store import DiskFull, RunStore
from kvbench.report.records import scan
d = Path(sys.argv[1]) / "run"
store = RunStore(d)
filler = Path(sys.argv[1]) / "filler"
record = {{"id": "", "score": 1.0, "scores": {{"m": 1.0}}, "prediction": "x" * 3000}}
n = 0
try:
    with open(filler, "wb") as f:  # leave about 20 kB free
        f.write(b"\0" * (os.statvfs(d).f_bavail * os.statvfs(d).f_frsize - 20_000))
    while True:
        store.append({{**record, "id": f"s{{n}}"}}); n += 1
except DiskFull as e:
    print("ERROR", e)
lines = scan((d / "predictions.jsonl").read_bytes())
print("LINES", len(lines), n, all(x.record is not None for x in lines))
filler.unlink()
store.append({{**record, "id": "after"}})
store.close()
print("AFTER", [x.record["id"] for x in scan((d / "predictions.jsonl").read_bytes())][-2:])
PY
mkdir -p "$d/full" && dd if=/dev/zero of="$d/full/filler" bs=4k 2>/dev/null
{python} -m kvbench.run {args} results_dir="$d/full/results"
echo "EXIT $?"
"""


def test_a_full_disk_tears_nothing_and_says_where_in_one_line(tmp_path):
    """A real full disk: a 256 kB tmpfs in a mount namespace of its own (root only; skipped elsewhere)."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux)")
    script = FULL_DISK.format(python=sys.executable, args=" ".join(f"'{a}'" for a in NEEDLE))
    out = subprocess.run(["unshare", "-m", "bash", "-c", script], cwd=ROOT, env=ENV, capture_output=True, text=True)
    if out.returncode == 77 or "Operation not permitted" in out.stderr[:300]:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()[:200]}")
    lines = out.stdout.splitlines()
    error = next(x for x in lines if x.startswith("ERROR"))
    assert "no space left on the device holding " in error and "predictions.jsonl" in error
    assert "rerun the same command: it resumes" in error
    _, n_lines, n_appended, whole = next(x for x in lines if x.startswith("LINES")).split()
    assert int(n_lines) == int(n_appended) > 0 and whole == "True"  # every line whole, none half-written
    assert next(x for x in lines if x.startswith("AFTER")) == f"AFTER ['s{int(n_appended) - 1}', 'after']"
    # the command: Hydra's own .hydra/ save fails first; one line naming the run directory, exit code 1
    assert lines[-1] == "EXIT 1"
    (stderr_line,) = [x for x in out.stderr.splitlines() if x.startswith("kvbench")]
    assert stderr_line.startswith("kvbench: no space left on the device holding ") and "/full/results/niah/" in \
        stderr_line
    assert "Traceback" not in out.stderr


# --- every sample failed --------------------------------------------------------------------------------------
def test_a_run_in_which_every_sample_failed_exits_non_zero_with_the_first_cause(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvbench.run", *NEEDLE, "method._target_=tests.unit.faulty.BrokenSnapKV",
                          "dataset.context_lengths=[300]", f"results_dir={tmp_path}"], cwd=ROOT, env=ENV,
                         capture_output=True, text=True)
    assert out.returncode == 1, out.stderr[-2000:]
    (run_dir,) = run_dirs(tmp_path)
    assert [r["failed"] for r in records(run_dir)] == [True, True]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"kvbench: no sample of {run_dir} succeeded (2 failed); the first: IndexError: index 99 "
                           "is out of bounds for dimension 2 with size 64 at kvbench/methods/"), last
