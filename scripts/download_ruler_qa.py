"""Download RULER's QA sources (SQuAD v2.0 dev for qa_1, HotpotQA dev distractor for qa_2) into a local folder.

    python scripts/download_ruler_qa.py [--out DIR]   # default: <kvbench cache>/data/ruler, where dataset=ruler looks
    python scripts/download_ruler_qa.py --sha256 hotpot_dev_distractor_v1.json=<hex>   # accept another copy

Run it on a machine that reaches the sources (the URLs of RULER's `download_qa_dataset.sh`), then copy the folder
to the machine that runs kvbench and set `dataset.qa_root=DIR` if it is not the default. Both files are
CC BY-SA 4.0; kvbench never ships them.

The files are fixed (no revision to resolve), so each is pinned by its size and sha256: a download or a file already
in DIR with another checksum is refused, not used (`--sha256 NAME=HEX` accepts a copy you vouch for instead).
`DIR/provenance.json` records each file's sha256, the pin and the URL it came from; kvbench puts it in every RULER
run's manifest (`dataset_provenance.qa_sources`).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from pinning import sha256_file, write_provenance


@dataclass(frozen=True)
class Source:
    size: int              # bytes
    sha256: str
    urls: tuple[str, ...]  # tried in order


# URLs: RULER c5341b4's download_qa_dataset.sh, then the pinned HotpotQA mirror RULER added in f954952. Sizes and
# sha256 as two independent downloaders recorded them for these URLs: TFDS question_answering/squad/checksums.tsv and
# HF datasets' datasets/squad_v2 and datasets/hotpot_qa dataset_infos.json (download_checksums).
SOURCES = {
    "dev-v2.0.json": Source(
        4_370_528, "80a5225e94905956a6446d296ca1093975c4d3b3260f1d6c8f68bc2ab77182d8",
        ("https://rajpurkar.github.io/SQuAD-explorer/dataset/dev-v2.0.json",)),
    "hotpot_dev_distractor_v1.json": Source(
        46_320_117, "4e9ecb5c8d3b719f624d66b60f8d56bf227f03914f5f0753d6fa1b359d7104ea",
        ("http://curtis.ml.cmu.edu/datasets/hotpot/hotpot_dev_distractor_v1.json",
         "https://huggingface.co/datasets/namlh2004/hotpotqa/resolve/7e54db4656209750ff487f6fdf8e39a66dba136b/"
         "hotpot_dev_distractor_v1.json")),
}


def default_out() -> Path:
    try:
        from kvbench.data.ruler import default_data_dir

        return default_data_dir()
    except ImportError:  # kvbench not installed here: the same default, spelled out
        return Path(os.environ.get("KVBENCH_CACHE", Path.home() / ".cache" / "kvbench")) / "data" / "ruler"


def check(name: str, data: bytes) -> str:
    """A light schema check (the content behind a checksum you vouched for); returns a one-line description."""
    obj = json.loads(data)
    if name.startswith("dev-v2.0"):
        n = sum(len(p["qas"]) for d in obj["data"] for p in d["paragraphs"])
        return f"{len(obj['data'])} articles, {n} questions"
    return f"{len(obj)} questions, first context paragraphs: {len(obj[0]['context'])}"


def download(name: str, source: Source, expected: str, out: Path, timeout: float) -> str | None:
    """Fetch `name` into `out` unless a copy with the `expected` sha256 is there; returns the URL it came from
    ("" for a copy already there), or None when no copy with that checksum could be had."""
    target = out / name
    if target.is_file():
        found = sha256_file(target)
        if found == expected:
            print(f"{target}: already there, sha256 matches, skipped")
            return ""
        print(f"{target}: sha256 {found} is not the expected {expected}: another or a damaged copy; move it away "
              f"and rerun (or pass --sha256 {name}={found} to use it)", file=sys.stderr)
        return None
    for url in source.urls:
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                data = response.read()
            digest = hashlib.sha256(data).hexdigest()
            if digest != expected:
                pinned = f" ({source.size:,} bytes)" if expected == source.sha256 else ""
                raise ValueError(f"{len(data):,} bytes with sha256 {digest}, not the expected {expected}{pinned}; "
                                 "not saved")
            info = check(name, data)
        except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError) as e:
            print(f"{name}: {url} failed ({e})", file=sys.stderr)
            continue
        tmp = target.with_suffix(".part")
        tmp.write_bytes(data)
        tmp.replace(target)
        print(f"{target}: {len(data):,} bytes, sha256 {digest[:16]}... as expected, {info}")
        return url
    return None


def parse_sha256(items: list[str]) -> dict[str, str]:
    """`NAME=HEX` pairs from --sha256, each naming one of SOURCES and giving a 64-digit hex sha256."""
    pins = {}
    for item in items:
        name, _, digest = item.partition("=")
        if name not in SOURCES:
            raise SystemExit(f"download_ruler_qa: --sha256 {item!r}: {name!r} is not one of {', '.join(SOURCES)}")
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest.lower()):
            raise SystemExit(f"download_ruler_qa: --sha256 {item!r}: give the file's 64 hex digits")
        pins[name] = digest.lower()
    return pins


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="target folder (default: %(default)s = kvbench cache)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    parser.add_argument("--sha256", action="append", default=[], metavar="NAME=HEX",
                        help="accept this checksum for NAME instead of the pinned one (recorded in provenance.json)")
    args = parser.parse_args(argv)
    vouched = parse_sha256(args.sha256)
    expected = {name: vouched.get(name, source.sha256) for name, source in SOURCES.items()}
    out = (args.out or default_out()).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    got = {name: download(name, source, expected[name], out, args.timeout) for name, source in SOURCES.items()}
    missing = [name for name, url in got.items() if url is None]
    if missing:
        urls = ", ".join(SOURCES[m].urls[0] for m in missing)
        print(f"download_ruler_qa: no copy with the pinned sha256 of {', '.join(missing)} (no route to the sources "
              f"from this machine, or they changed). Download {urls} elsewhere, put the files in {out} (or any folder "
              "and set dataset.qa_root), and rerun; without them RULER skips qa_1/qa_2.", file=sys.stderr)
        return 1
    write_provenance(out, "RULER qa_1/qa_2 sources (NVIDIA/RULER c5341b4 download_qa_dataset.sh)", None, None,
                     [out / name for name in SOURCES], pinned_sha256={n: s.sha256 for n, s in SOURCES.items()},
                     vouched_sha256=vouched, urls={name: url or None for name, url in got.items()})
    print(f"done: set dataset.qa_root={out} if that is not the default ({default_out()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
