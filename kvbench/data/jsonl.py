"""Reading a benchmark's local `<name>.jsonl` (or `.jsonl.gz`) file with one-line errors that name file and line.

The seed-paper datasets (summarization, 10-document QA, Wikitext, InfiniteBench) are read from a folder
(`dataset.root`) holding files with the source's own field names; this checks the fields a builder needs. The
download scripts write `provenance.json` beside the files (source, the revision asked for, the commit read); a
builder hands it to the manifest (`dataset_provenance`).
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path


def find_file(root: str | Path, stem: str) -> Path | None:
    """`<root>/<stem>.jsonl`, or its gzipped twin as some sources ship it; None if neither exists."""
    root = Path(root).expanduser()
    for name in (f"{stem}.jsonl", f"{stem}.jsonl.gz"):
        if (root / name).is_file():
            return root / name
    return None


def read_jsonl(path: Path, required: dict[str, type | tuple[type, ...]], who: str,
               line_key: str | None = None) -> list[dict]:
    """Records of a jsonl file in file order; each must be an object with `required` fields of the given types.
    With `line_key`, each record also gets its line number under that key (for later one-line errors)."""
    opener = gzip.open if path.suffix == ".gz" else open
    records = []
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{who}: {path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{who}: {path}:{lineno}: expected a JSON object, got {type(record).__name__}")
            for key, kind in required.items():
                value = record.get(key)
                if not isinstance(value, kind) or isinstance(value, bool):
                    names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
                    raise ValueError(f"{who}: {path}:{lineno}: field '{key}' must be a {names}, got {value!r:.40}")
            if line_key is not None:
                record[line_key] = lineno
            records.append(record)
    return records


def read_provenance(root: str | Path, who: str) -> dict:
    """`<root>/provenance.json` as a download script wrote it; {} for a folder made by hand (nothing to record)."""
    path = Path(root).expanduser() / "provenance.json"
    if not path.is_file():
        return {}
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{who}: {path}: not valid JSON ({e.msg} at line {e.lineno}); rerun the download script "
                         "or delete the file") from None
    if not isinstance(record, dict):
        raise ValueError(f"{who}: {path}: expected a JSON object, got {type(record).__name__}")
    return record


def check_unique(records: list[dict], key: str, path: Path, who: str) -> None:
    seen: set = set()
    for r in records:
        if r[key] in seen:
            raise ValueError(f"{who}: {path}: {key} {r[key]!r} repeats; sample ids must be unique.")
        seen.add(r[key])
