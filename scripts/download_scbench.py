"""Download SCBench's task files into the folder kvbench reads (needs the Hugging Face Hub).

    python scripts/download_scbench.py                       # the six tasks kvbench builds, into data/scbench/
    python scripts/download_scbench.py --out /data/scbench scbench_kv scbench_qa_eng

Fetches `data/<task>.jsonl` of the Hub dataset `microsoft/SCBench` (the files upstream's
`check_benchmark_availability` downloads) and copies each to `<out>/<task>.jsonl` unchanged, so the records keep
their own fields (`id`, `context`, `multi_turns`). kvbench never downloads at run time: a missing folder is a
one-line error naming this script.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

REPO = "microsoft/SCBench"
TASKS = ("scbench_kv", "scbench_prefix_suffix", "scbench_qa_eng", "scbench_choice_eng", "scbench_many_shot",
         "scbench_summary")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tasks", nargs="*", help=f"any of {', '.join(TASKS)} (default: all six)")
    parser.add_argument("--out", default="data/scbench", help="target folder (default: data/scbench)")
    parser.add_argument("--revision", default=None, help="Hub revision (default: main)")
    args = parser.parse_args()
    unknown = [t for t in args.tasks if t not in TASKS]
    if unknown:
        parser.error(f"unknown task {unknown[0]!r}; choose from {', '.join(TASKS)}")
    from huggingface_hub import hf_hub_download

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for task in args.tasks or TASKS:
        path = hf_hub_download(REPO, f"data/{task}.jsonl", repo_type="dataset", revision=args.revision)
        shutil.copy(path, out / f"{task}.jsonl")
        print(f"wrote {out / f'{task}.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
