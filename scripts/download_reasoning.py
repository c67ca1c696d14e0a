"""Download the reasoning sets (issue 32) into the local folders kvbench reads (needs the Hugging Face Hub).

    python scripts/download_reasoning.py gsm8k math500 aime24 aime25
    python scripts/download_reasoning.py aime24 --revision <commit or tag>        # pin the source's revision
    python scripts/download_reasoning.py aime25 --aime25-source <repo> --aime25-split test   # another mirror

Writes data/<name>/test.jsonl (gsm8k: also train.jsonl, its few-shot pool) with the source's own field names, and
data/<name>/provenance.json: source, config, split, the revision asked for and the commit it resolved to (the data
are read at that commit), rows, each file's sha256, time; kvbench puts it in every run's manifest. Sources:
openai/gsm8k (config main; test, train), HuggingFaceH4/MATH-500 (test), HuggingFaceH4/aime_2024 (train ->
test.jsonl), yentinglin/aime_2025 (train -> test.jsonl; the problem text, an AIME 2025 mirror's default; another
mirror needs `problem` or `question`, and `answer`). The AIME 2025 source is not fixed by any reference kvbench
follows (kvpress reads its own `alessiodevoto/aime25`): check the 30 problems and the provenance when you compare
numbers.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Iterable, NamedTuple

from pinning import resolve_revision, write_provenance


class Source(NamedTuple):
    repo: str
    config: str | None
    splits: dict[str, str]   # local file stem -> the source's split
    fields: tuple[str, ...]  # written when present; `required` must be
    required: tuple[str, ...]


MATH_FIELDS = ("id", "problem", "solution", "answer", "subject", "level", "unique_id", "url", "year")
SOURCES = {
    "gsm8k": Source("openai/gsm8k", "main", {"test": "test", "train": "train"}, ("question", "answer"),
                    ("question", "answer")),
    "math500": Source("HuggingFaceH4/MATH-500", None, {"test": "test"}, MATH_FIELDS, ("problem", "answer")),
    "aime24": Source("HuggingFaceH4/aime_2024", None, {"test": "train"}, MATH_FIELDS, ("problem", "answer")),
    "aime25": Source("yentinglin/aime_2025", None, {"test": "train"}, MATH_FIELDS, ("problem", "answer")),
}
ALIASES = {"question": "problem"}  # AIME mirrors that call the problem `question` (not GSM8K, whose field it is)


def load_rows(repo: str, config: str | None, split: str, revision: str) -> Iterable[dict]:
    from datasets import load_dataset

    return load_dataset(repo, config, split=split, revision=revision)


def convert(row: dict, source: Source, where: str) -> dict:
    """The fields kvbench reads, in the source's names (an AIME mirror's `question` becomes `problem`); AIME answers
    as strings."""
    if "question" not in source.required:
        row = {ALIASES.get(k, k): v for k, v in row.items()}
    missing = [k for k in source.required if k not in row]
    if missing:
        raise SystemExit(f"download_reasoning: {where} has no field {', '.join(missing)} (fields: {', '.join(row)})")
    out = {k: row[k] for k in source.fields if k in row}
    if "answer" in out and not isinstance(out["answer"], str):
        out["answer"] = str(out["answer"])
    return out


def download(name: str, source: Source, out: Path, revision: str) -> None:
    """Every split at the commit `revision` resolves to (the requested revision where it cannot be resolved)."""
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    resolved = resolve_revision(source.repo, revision)
    rows_written, written = {}, []
    for stem, split in source.splits.items():
        rows = [convert(dict(r), source, f"{source.repo}:{split}") for r in load_rows(source.repo, source.config,
                                                                                        split, resolved or revision)]
        with open(folder / f"{stem}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        rows_written[stem] = len(rows)
        written.append(folder / f"{stem}.jsonl")
        print(f"wrote {folder / f'{stem}.jsonl'} ({len(rows)} rows of {source.repo}:{split})")
    write_provenance(folder, source.repo, revision, resolved, written, config=source.config, splits=source.splits,
                     rows=rows_written)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="+", choices=list(SOURCES))
    parser.add_argument("--out", default="data", help="parent folder (default: data)")
    parser.add_argument("--revision", default="main", help="the sources' revision: branch, tag or commit (main)")
    parser.add_argument("--aime25-source", default=SOURCES["aime25"].repo)
    parser.add_argument("--aime25-config", default=None)
    parser.add_argument("--aime25-split", default="train")
    args = parser.parse_args(argv)
    sources = {**SOURCES, "aime25": SOURCES["aime25"]._replace(repo=args.aime25_source, config=args.aime25_config,
                                                                splits={"test": args.aime25_split})}
    for name in args.names:
        download(name, sources[name], Path(args.out), args.revision)
    return 0


if __name__ == "__main__":
    sys.exit(main())
