"""Download RULER's QA sources (SQuAD v2.0 dev for qa_1, HotpotQA dev distractor for qa_2) into a local folder.

    python scripts/download_ruler_qa.py [--out DIR]   # default: <kvbench cache>/data/ruler, where dataset=ruler looks

Run it on a machine that reaches the sources (the URLs of RULER's `download_qa_dataset.sh`), then copy the folder
to the machine that runs kvbench and set `dataset.qa_root=DIR` if it is not the default. Both files are
CC BY-SA 4.0; kvbench never ships them.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

# file name -> URLs tried in order: RULER c5341b4's download_qa_dataset.sh, then the pinned HotpotQA mirror that
# RULER added in f954952 (the same file)
SOURCES = {
    "dev-v2.0.json": ["https://rajpurkar.github.io/SQuAD-explorer/dataset/dev-v2.0.json"],
    "hotpot_dev_distractor_v1.json": [
        "http://curtis.ml.cmu.edu/datasets/hotpot/hotpot_dev_distractor_v1.json",
        ("https://huggingface.co/datasets/namlh2004/hotpotqa/resolve/7e54db4656209750ff487f6fdf8e39a66dba136b/"
         "hotpot_dev_distractor_v1.json"),
    ],
}


def default_out() -> Path:
    try:
        from kvbench.data.ruler import default_data_dir

        return default_data_dir()
    except ImportError:  # kvbench not installed here: the same default, spelled out
        return Path(os.environ.get("KVBENCH_CACHE", Path.home() / ".cache" / "kvbench")) / "data" / "ruler"


def check(name: str, data: bytes) -> str:
    """A light schema check so a proxy's HTML error page is not saved as data; returns a one-line description."""
    obj = json.loads(data)
    if name.startswith("dev-v2.0"):
        n = sum(len(p["qas"]) for d in obj["data"] for p in d["paragraphs"])
        return f"{len(obj['data'])} articles, {n} questions"
    return f"{len(obj)} questions, first context paragraphs: {len(obj[0]['context'])}"


def download(name: str, urls: list[str], out: Path, timeout: float) -> bool:
    target = out / name
    if target.is_file():
        print(f"{target}: already there, skipped")
        return True
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                data = response.read()
            info = check(name, data)
        except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError) as e:
            print(f"{name}: {url} failed ({e})", file=sys.stderr)
            continue
        tmp = target.with_suffix(".part")
        tmp.write_bytes(data)
        tmp.replace(target)
        print(f"{target}: {len(data):,} bytes, sha256 {hashlib.sha256(data).hexdigest()[:16]}..., {info}")
        return True
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="target folder (default: %(default)s = kvbench cache)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    args = parser.parse_args(argv)
    out = (args.out or default_out()).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    missing = [name for name, urls in SOURCES.items() if not download(name, urls, out, args.timeout)]
    if missing:
        print(f"download_ruler_qa: could not fetch {', '.join(missing)} (no route to the sources from this machine?). "
              f"Download {', '.join(u for m in missing for u in SOURCES[m][:1])} elsewhere, put the files in {out} "
              f"(or any folder and set dataset.qa_root), and rerun; without them RULER skips qa_1/qa_2.",
              file=sys.stderr)
        return 1
    print(f"done: set dataset.qa_root={out} if that is not the default ({default_out()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
