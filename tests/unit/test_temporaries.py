"""Caches written file by file (NIAH's tokenized texts, RULER's samples) leave no temporaries behind: a write goes
through a locked temporary renamed when whole, and a process's first write into a folder removes what writers killed
mid-write (SIGKILL: no cleanup ran) left there, never what a live writer is writing."""
from __future__ import annotations

import fcntl
import json
import subprocess
import sys

from kvbench.data.ruler import cache
from kvbench.disk import temporaries


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_the_first_write_into_a_folder_removes_dead_writers_temporaries_only(tmp_path, monkeypatch):
    monkeypatch.setattr(temporaries, "_swept", set())
    folder = tmp_path / "vt"
    folder.mkdir()
    old_style = folder / f"L4096-s42-abc.jsonl.tmp{dead_pid()}"  # kvbench before this change: no leading dot
    killed = folder / f".L4096-s42-abc.jsonl.tmp{dead_pid()}"
    live = folder / f".other.jsonl.tmp{dead_pid()}"  # its pid is gone, but a writer elsewhere holds its lock
    for f in (old_style, killed, live):
        f.write_text("half a file")
    with open(live, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        path = folder / "L4096-s42-abc.jsonl"
        cache.write_records(path, [{"input": "x", "outputs": ["1"]}], {"task": "vt"})
        assert sorted(p.name for p in folder.iterdir()) == sorted(
            [live.name, path.name, path.with_suffix(".key.json").name])
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"input": "x", "outputs": ["1"]}]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "ids.npy"
    path.write_bytes(b"old")

    def fail(f):
        f.write(b"new, half")
        raise OSError("disk full")

    try:
        temporaries.replace_whole(path, fail)
    except OSError:
        pass
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["ids.npy"]
