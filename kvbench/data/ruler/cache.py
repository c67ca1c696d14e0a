"""Generated RULER samples cached on disk, so a sweep over methods and budgets generates each task once.

One JSONL file of upstream records per (task, length, tokenizer, seed, version, and every other input that changes
the text): `<cache_dir>/<version>/<task>/L<length>-s<seed>-<key>.jsonl`. Samples are drawn in sequence from one
RNG, so the first n of a longer file are exactly the n a shorter run would make: a file with at least n records
serves any request for n; a request for more regenerates and replaces it. Writes are atomic (temp file + rename),
so parallel jobs that race on one file each leave a whole, identical file.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Callable

from kvbench.disk.temporaries import replace_whole
from kvbench.pathnames import check_inside

logger = logging.getLogger(__name__)


def cache_file(cache_dir: Path, version: str, task: str, length: int, seed: int, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(cache_dir) / version / task / f"L{length}-s{seed}-{digest}.jsonl"
    return check_inside(path, Path(cache_dir), "ruler: sample cache")  # version and task are config values


def read_records(path: Path) -> list[dict]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line.strip()]
    except (OSError, json.JSONDecodeError):
        return []


def write_records(path: Path, records: list[dict], key: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    replace_whole(path, lambda f: f.write(text.encode("utf-8")))  # (a killed writer's temporary: removed later)
    path.with_suffix(".key.json").write_text(json.dumps(key, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def cached(path: Path | None, num_samples: int, make: Callable[[], list[dict]], key: dict) -> tuple[list[dict], bool]:
    """The first `num_samples` records from `path` if it holds that many, else `make()` (written to `path`).
    Returns (records, came_from_cache). `path=None` disables the cache."""
    if path is not None:
        records = read_records(path)
        if len(records) >= num_samples:
            return records[:num_samples], True
    records = make()
    if path is not None:
        try:
            write_records(path, records, key)
        except OSError as e:  # a read-only cache must not cost the run
            logger.warning("ruler: could not write the sample cache %s: %s", path, e)
    return records, False
