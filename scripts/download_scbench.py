"""Download SCBench's task files into the folder kvbench reads (needs the Hugging Face Hub).

    python scripts/download_scbench.py                       # the six tasks kvbench builds, into data/scbench/
    python scripts/download_scbench.py --out /data/scbench scbench_kv scbench_qa_eng
    python scripts/download_scbench.py --revision <commit>   # pin the Hub dataset's revision

Fetches `data/<task>.jsonl` of the Hub dataset `microsoft/SCBench` (the files upstream's
`check_benchmark_availability` downloads) and copies each to `<out>/<task>.jsonl` unchanged, so the records keep
their own fields (`id`, `context`, `multi_turns`). The revision (default main) is resolved to its commit first and the
files are read at that commit; `<out>/provenance.json` records both and each file's sha256, and kvbench puts it in
every run's manifest. kvbench never downloads at run time: a missing folder is a one-line error naming this script.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from pinning import resolve_revision, write_provenance

REPO = "microsoft/SCBench"
TASKS = ("scbench_kv", "scbench_prefix_suffix", "scbench_qa_eng", "scbench_choice_eng", "scbench_many_shot",
         "scbench_summary")


def hub_file(filename: str, revision: str) -> str:
    from huggingface_hub import hf_hub_download

    return hf_hub_download(REPO, filename, repo_type="dataset", revision=revision)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tasks", nargs="*", help=f"any of {', '.join(TASKS)} (default: all six)")
    parser.add_argument("--out", default="data/scbench", help="target folder (default: data/scbench)")
    parser.add_argument("--revision", default="main", help="Hub revision: branch, tag or commit (default: main)")
    args = parser.parse_args(argv)
    unknown = [t for t in args.tasks if t not in TASKS]
    if unknown:
        parser.error(f"unknown task {unknown[0]!r}; choose from {', '.join(TASKS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    resolved = resolve_revision(REPO, args.revision)
    written = []
    for task in args.tasks or TASKS:
        shutil.copy(hub_file(f"data/{task}.jsonl", resolved or args.revision), out / f"{task}.jsonl")
        written.append(out / f"{task}.jsonl")
        print(f"wrote {out / f'{task}.jsonl'}")
    write_provenance(out, REPO, args.revision, resolved, written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
