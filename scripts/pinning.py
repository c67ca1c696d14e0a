"""What the download scripts beside this file record about a source: the commit a revision resolves to, the files'
sha256, and `provenance.json` next to the data (kvbench reads it into every run's manifest, `dataset_provenance`);
and the JSONL they write it as (`write_jsonl`).

A branch or tag moves (InfiniteBench's files were re-uploaded in 2024; Lost in the Middle's in 2024-01), so a script
resolves the revision it was given to a commit first, reads the data at that commit, and records both.
"""
from __future__ import annotations

import hashlib
import json
import re
import sys
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable

COMMIT = re.compile(r"[0-9a-f]{40}")


def resolve_revision(repo: str, revision: str, repo_type: str = "dataset") -> str | None:
    """The commit a Hub branch or tag names (a commit names itself); None if the Hub cannot be asked."""
    if COMMIT.fullmatch(revision):
        return revision
    try:
        from huggingface_hub import HfApi

        return HfApi().repo_info(repo, revision=revision, repo_type=repo_type).sha
    except Exception as e:  # noqa: BLE001 - offline, gated, a typo: the requested revision is still recorded
        print(f"warning: cannot resolve {repo}@{revision} to a commit ({type(e).__name__}); provenance.json records "
              "the requested revision only", file=sys.stderr)
        return None


def resolve_github(repo: str, ref: str, timeout: float = 30.0) -> str | None:
    """The commit a GitHub branch or tag names (GitHub's API; a commit names itself); None if it cannot be asked."""
    if COMMIT.fullmatch(ref):
        return ref
    request = urllib.request.Request(f"https://api.github.com/repos/{repo}/commits/{ref}",
                                     headers={"Accept": "application/vnd.github.sha"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            sha = response.read().decode().strip()
        return sha if COMMIT.fullmatch(sha) else None
    except OSError as e:
        print(f"warning: cannot resolve github:{repo}@{ref} to a commit ({e}); provenance.json records the requested "
              "ref only", file=sys.stderr)
        return None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_provenance(folder: Path, source: str, revision: str | None, resolved_revision: str | None,
                     files: list[Path], **extra) -> Path:
    """`<folder>/provenance.json`: the source, the revision asked for and the commit read, each file's sha256 (and
    `extra`: config, splits, rows, ...), and the time."""
    record = {"source": source, **extra, "revision": revision, "resolved_revision": resolved_revision,
              "files": {p.name: sha256_file(p) for p in files},
              "written_utc": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    path = folder / "provenance.json"
    path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return path


def write_jsonl(rows: Iterable[dict], path: Path, fields: tuple[str, ...], where: str, script: str) -> int:
    """The `fields` of each row, one JSON line each; a row without one of them stops `script`, naming `where`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            missing = [k for k in fields if k not in row]
            if missing:
                raise SystemExit(f"{script}: {where} has no field {', '.join(missing)} "
                                 f"(fields: {', '.join(row)})")
            f.write(json.dumps({k: row[k] for k in fields}, ensure_ascii=False) + "\n")
            n += 1
    print(f"wrote {path} ({n} rows of {where})")
    return n

