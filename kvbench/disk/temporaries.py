"""Temporaries named after their writer (`<name>.tmp<pid>`), and which ones a dead writer left behind.

kvbench writes a file or a folder whole by building it under a temporary name and renaming it over the real one
(a run folder's manifest.json and scores.json, a converted model). A writer killed by SIGKILL leaves its temporary
behind for ever (a converted model's is ~514 MB), so the next writer removes it, but only when nothing can still be
writing it: its pid names no process on this host, and the lock its writer held while writing (an flock, which the
kernel releases when a process dies, whatever killed it) is free. The lock covers writers on other hosts of a shared
file system, whose pids mean nothing here; the pid covers writers of kvbench versions that took no lock.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

logger = logging.getLogger(__name__)

TEMPORARY = re.compile(r"(?P<base>.+)\.tmp(?P<pid>\d+)")


def temporary_name(name: str) -> str:
    """This process's temporary for `name`."""
    return f"{name}.tmp{os.getpid()}"


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists on this host (a zombie still counts until its parent reaps it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def lock_held(path: Path) -> bool:
    """Whether another open file holds an flock on `path` (asked without waiting; a read-only open suffices)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the shared lock this check took
    return False


@contextlib.contextmanager
def locked_temporary_file(path: Path) -> Iterator[tuple[Path, BinaryIO]]:
    """Open `.<name>.tmp<pid>` beside `path` for writing, holding an flock on it until it is closed, so a cleaner on
    any host sees a live writer. The caller renames it over `path` inside the block; on any error it is removed."""
    tmp = path.with_name(temporary_name(f".{path.name}"))
    try:
        with open(tmp, "wb") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield tmp, f
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


_swept: set[Path] = set()


def replace_whole(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write `path` whole: `write(f)` into a locked temporary beside it, renamed over it when written (removed on any
    error). For caches many processes write file by file (NIAH's tokenized texts, RULER's samples): the first write
    of a process into a folder removes the temporaries that dead writers (SIGKILL) left there."""
    if path.parent not in _swept:
        remove_dead_temporaries(path.parent)
        _swept.add(path.parent)
    with locked_temporary_file(path) as (tmp, f):
        write(f)
        f.flush()
        os.replace(tmp, path)


def dead_writer(tmp: Path, lock: Path | None) -> bool:
    """Whether the writer of temporary `tmp` is dead: its pid is not alive here and `lock` (None: no lock to ask,
    the caller holds it) is not held."""
    match = TEMPORARY.fullmatch(tmp.name)
    if match is None or pid_alive(int(match["pid"])):
        return False
    return lock is None or not lock_held(lock)


def remove_dead_temporaries(folder: Path, lock_of: Callable[[Path], Path | None] = lambda tmp: tmp,
                            prefix: str = "") -> list[Path]:
    """Remove the temporaries in `folder` (files or folders named `<prefix>*.tmp<pid>`) whose writer is dead;
    `lock_of(tmp)` is the file its writer held locked (default: the temporary itself). Returns what was removed; an
    entry that cannot be removed is left, with a log line."""
    removed = []
    if not folder.is_dir():
        return removed
    for entry in sorted(folder.iterdir()):
        if (not entry.name.startswith(prefix) or entry.is_symlink() or TEMPORARY.fullmatch(entry.name) is None
                or not dead_writer(entry, lock_of(entry))):
            continue
        try:
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink(missing_ok=True)
        except OSError as e:
            logger.warning("%s: a dead writer's temporary, not removed (%s)", entry, e)
            continue
        logger.info("removed %s, left by a writer that died (pid %s)", entry, TEMPORARY.fullmatch(entry.name)["pid"])
        removed.append(entry)
    return removed
