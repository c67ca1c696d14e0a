"""Download LongBench v2, ZeroSCROLLS and LooGLE into the folders kvbench reads (needs the Hugging Face Hub).

    python scripts/download_long_context.py longbench_v2 zero_scrolls loogle
    python scripts/download_long_context.py zero_scrolls --split test       # hidden answers: predictions only
    python scripts/download_long_context.py loogle --revision <commit>      # pin the source's revision

No loading script runs (`datasets` >= 4 refuses them; tau/zero_scrolls and bigainlco/LooGLE have one on main):
- longbench_v2: THUDM/LongBench-v2's `data.json` (main), read by the json builder -> data/longbench_v2/data.jsonl.
- zero_scrolls: tau/zero_scrolls's parquet export (refs/convert/parquet, `<task>/<split>/*.parquet`) ->
  data/zero_scrolls/<task>_<split>.jsonl; `validation` (about 20 per task, with answers: kvbench scores it) or `test`
  (answers hidden; kvpress runs it and scores nothing).
- loogle: bigainlco/LooGLE's parquet export (`<task>/test/*.parquet`) -> data/loogle/<task>.jsonl.
The parquet exports' file layout could not be checked from here (no Hub): if the Hub lays them out otherwise, pass
`--parquet-pattern`. Each revision is resolved to a commit first and the data are read at that commit;
provenance.json records source, revision, commit, files' sha256 and rows (kvbench puts it in every manifest).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Iterable
from urllib.parse import quote

from pinning import resolve_revision, write_jsonl, write_provenance

LONGBENCH_V2 = ("THUDM/LongBench-v2", "main")
ZERO_SCROLLS = ("tau/zero_scrolls", "refs/convert/parquet")
LOOGLE = ("bigainlco/LooGLE", "refs/convert/parquet")
ZERO_SCROLLS_TASKS = ("gov_report", "summ_screen_fd", "qmsum", "qasper", "narrative_qa", "quality", "musique",
                      "squality", "space_digest", "book_sum_sort")
LOOGLE_TASKS = ("shortdep_qa", "longdep_qa", "shortdep_cloze", "longdep_summarization")
FIELDS = {
    "longbench_v2": ("_id", "domain", "sub_domain", "difficulty", "length", "question", "choice_A", "choice_B",
                     "choice_C", "choice_D", "answer", "context"),
    "zero_scrolls": ("id", "pid", "input", "output", "document_start_index", "document_end_index",
                     "query_start_index", "query_end_index", "truncation_seperator"),
    "loogle": ("input", "title", "qa_pairs", "output"),
}


def hub_base(repo: str, revision: str) -> str:
    return f"hf://datasets/{repo}@{revision if revision.startswith('refs/') else quote(revision, safe='')}"


def load_files(builder: str, files: str, split: str) -> Iterable[dict]:
    """Rows of Hub files through a `datasets` file builder (json or parquet: no loading script runs)."""
    from datasets import load_dataset

    return load_dataset(builder, data_files={split: files}, split=split)




def download(name: str, out: Path, revision: str | None, split: str, pattern: str | None) -> None:
    repo, default_revision = {"longbench_v2": LONGBENCH_V2, "zero_scrolls": ZERO_SCROLLS, "loogle": LOOGLE}[name]
    revision = revision or default_revision
    resolved = resolve_revision(repo, revision)
    base = hub_base(repo, resolved or revision)
    folder = out / name
    if name == "longbench_v2":
        jobs = [("data.json", "json", folder / "data.jsonl", "train")]
    else:
        tasks, split = (ZERO_SCROLLS_TASKS, split) if name == "zero_scrolls" else (LOOGLE_TASKS, "test")
        pattern = pattern or "{task}/{split}/*.parquet"
        stem = "{task}_{split}.jsonl" if name == "zero_scrolls" else "{task}.jsonl"
        jobs = [(pattern.format(task=t, split=split), "parquet", folder / stem.format(task=t, split=split), split)
                for t in tasks]
    rows, written = {}, []
    for files, builder, path, part in jobs:
        rows[path.stem] = write_jsonl(load_files(builder, f"{base}/{files}", part), path, FIELDS[name],
                                      f"{repo}@{resolved or revision}:{files}", "download_long_context")
        written.append(path)
    write_provenance(folder, repo, revision, resolved, written, split=jobs[0][3], data_files=[j[0] for j in jobs],
                     rows=rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="+", choices=list(FIELDS))
    parser.add_argument("--out", default="data", help="parent folder (default: data)")
    parser.add_argument("--revision", default=None, help="branch, tag or commit (default: main for longbench_v2, "
                        "refs/convert/parquet for the parquet exports)")
    parser.add_argument("--split", default="validation", choices=["validation", "test"], help="zero_scrolls split")
    parser.add_argument("--parquet-pattern", default=None, help="files of one task in a parquet export, with {task} "
                        "and {split} (default {task}/{split}/*.parquet)")
    args = parser.parse_args(argv)
    for name in args.names:
        download(name, Path(args.out), args.revision, args.split, args.parquet_pattern)
    return 0


if __name__ == "__main__":
    sys.exit(main())
