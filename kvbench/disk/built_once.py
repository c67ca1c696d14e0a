"""A folder built once into kvbench's cache (a GGUF model converted to safetensors): built whole, checked before use.

A conversion takes 30-150 s (the embedded SmolLM2, kvbench/models/embedded.py), so it runs once per cache: under the
cache's lock (a second process waits for the first instead of converting again), into `<name>.tmp<pid>`, renamed
when complete, with `kvbench-checksums.json` listing each file's size and xxh3-128 digest. Every process checks a
folder against it once before using it: a truncated or corrupted file (same size or not) is built again, or, where
the cache cannot be written, refused in one line naming the folder. xxh3-128 over a memory map reads SmolLM2's 538 MB
in 0.3 s wall, 0.09 s CPU, on 2 cores at load 10 (sha256: 1.6 s, 0.42 s CPU; docs/troubleshooting.md, "The converted
model cache"); it guards against damage, not against an attacker. Temporaries of a conversion that was killed
are removed by the next.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import mmap
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from kvbench.disk.temporaries import remove_dead_temporaries, temporary_name

logger = logging.getLogger(__name__)

CHECKSUMS = "kvbench-checksums.json"
ALGORITHM = "xxh3_128"
LOCK = ".convert.lock"  # in the cache's models/ folder: held by the process converting
CHUNK_BYTES = 64 << 20

_verified: dict[Path, tuple] = {}  # folder -> its files' stat when this process last found it whole


class ModelCacheError(ValueError):
    """The model cache cannot be used as it is (a one-line message naming the folder and what to do)."""


def digest(path: Path) -> str:
    """xxh3-128 of the file, read through a memory map (a read() copy of 538 MB cost 0.6-0.9 s on a loaded
    2-core machine, the map 0.16-0.35 s)."""
    import xxhash

    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return h.hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            mapped.madvise(mmap.MADV_SEQUENTIAL)
            view = memoryview(mapped)
            try:
                for start in range(0, len(view), CHUNK_BYTES):
                    h.update(view[start:start + CHUNK_BYTES])
            finally:
                view.release()
    return h.hexdigest()


def write_checksums(folder: Path) -> None:
    """List every file of `folder` (its size and digest) in `kvbench-checksums.json`."""
    files = {p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, ALGORITHM: digest(p)}
             for p in sorted(folder.rglob("*")) if p.is_file() and p.name != CHECKSUMS}
    (folder / CHECKSUMS).write_text(json.dumps({"algorithm": ALGORITHM, "files": files}, indent=1) + "\n")


def stat_key(folder: Path, names: list[str]) -> tuple:
    stats = [(folder / name).stat() for name in names]
    return tuple((s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_ino) for s in stats)


def problem(folder: Path) -> str | None:
    """What is wrong with converted folder `folder` (missing, no checksums, a file missing, truncated or changed),
    or None when every listed file is as written. Digests are computed once per process per unchanged folder."""
    if not folder.is_dir():
        return "it is not there"
    try:
        listed = {name: (int(entry["bytes"]), str(entry[ALGORITHM]))
                  for name, entry in json.loads((folder / CHECKSUMS).read_text())["files"].items()}
        names = sorted(listed)
    except FileNotFoundError:
        return f"it has no {CHECKSUMS} (converted by an earlier kvbench, or a copy)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"its {CHECKSUMS} is unreadable ({type(e).__name__})"
    try:
        for name in names:
            path = folder / name
            if not path.is_file():
                return f"{name} is missing"
            if path.stat().st_size != listed[name][0]:
                return f"{name} has {path.stat().st_size} bytes, {listed[name][0]} were written (truncated?)"
        key = stat_key(folder, names)
        if _verified.get(folder) == key:
            return None
        for name in names:
            if digest(folder / name) != listed[name][1]:
                return f"{name} differs from what was written ({ALGORITHM} digest; damaged on disk?)"
    except OSError as e:  # unreadable, or replaced by a conversion in another process while being read
        return f"{Path(e.filename or folder).name} is unreadable ({e.strerror or type(e).__name__})"
    _verified[folder] = key
    return None


def writable_problem(root: Path) -> str | None:
    """Why a folder cannot be written under `root`, found by trying (os.access answers yes to root on a folder
    without write bits); None when it can."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".kvbench-probe-", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"{e.strerror or type(e).__name__}: {e.filename or root}"
    return None


def check_usable(folder: Path, what: str) -> None:
    """Before anything is written: raise a one-line ModelCacheError when `folder` is not whole and its cache
    cannot be written, so the conversion that would make it could not succeed."""
    wrong = problem(folder)
    if wrong is not None:
        refuse_if_unwritable(folder, what, wrong)


def refuse_if_unwritable(folder: Path, what: str, wrong: str) -> None:
    cannot = writable_problem(folder.parent)
    if cannot is not None:
        raise ModelCacheError(f"model cache: {what} must be converted into {folder} ({wrong}), but the cache cannot "
                              f"be written ({cannot}); make {folder.parent} writable, or set KVBENCH_CACHE to a "
                              "writable folder")


@contextlib.contextmanager
def conversion_lock(models: Path) -> Iterator[None]:
    """Hold the cache's conversion lock, waiting for a process that converts now (a conversion ends; no timeout)."""
    with open(models / LOCK, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            logger.info("%s: %s is converting a model; waiting for it", models, holder)
            fcntl.flock(lock, fcntl.LOCK_EX)
        lock.truncate(0)
        lock.write(f"{socket.gethostname()} pid {os.getpid()}\n")
        lock.flush()
        yield


def build_once(folder: Path, what: str, write: Callable[[Path], None]) -> Path:
    """`folder`, checked; if it is not whole, built again by `write(tmp)` into a temporary renamed over it."""
    wrong = problem(folder)
    if wrong is None:
        return folder
    refuse_if_unwritable(folder, what, wrong)  # one line now instead of a permission error after the conversion
    with conversion_lock(folder.parent):
        # we hold the lock every converter holds: a temporary whose pid is dead here is a dead writer's
        remove_dead_temporaries(folder.parent, lambda tmp: None)
        wrong = problem(folder)  # another process may have converted it while we waited
        if wrong is None:
            return folder
        if folder.exists():
            logger.warning("model cache: %s: %s; converting %s again", folder, wrong, what)
        tmp = folder.with_name(temporary_name(folder.name))
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            write(tmp)
            write_checksums(tmp)
            if folder.exists():  # aside first: a rename does not replace a folder that holds files
                old = folder.with_name(temporary_name(folder.name + ".old"))
                folder.rename(old)
                tmp.rename(folder)
                shutil.rmtree(old, ignore_errors=True)
            else:
                tmp.rename(folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    wrong = problem(folder)
    if wrong is not None:  # written and read back different: the disk itself is failing
        raise ModelCacheError(f"model cache: {folder} was just converted but {wrong}; check the disk, or set "
                              "KVBENCH_CACHE to a folder on another one")
    return folder
