"""Fetch LongBench v1's data.zip (THUDM/LongBench on the Hugging Face Hub) and unpack it for kvbench.

    python scripts/download_longbench.py                       # needs the Hub; writes data/longbench/*.jsonl
    python scripts/download_longbench.py --revision <commit>   # pin the Hub dataset's revision (default main)
    python scripts/download_longbench.py --zip ~/data.zip      # a data.zip fetched elsewhere (no network needed)
    python -m kvbench.run dataset=longbench dataset.root=data/longbench ...

`datasets>=4` can no longer run LongBench's loading script, so kvbench reads the files of data.zip itself: the zip
holds `data/{task}.jsonl` (21 tasks) and `data/{task}_e.jsonl` (13 LongBench-E tasks), 114 MB. This script unpacks
them flat into `--root`, then writes `SOURCE.json` there (zip sha256, record count and sha256 per file) and warns
when a file's record count differs from LongBench's task.md. The revision is resolved to its commit first and data.zip
is read at that commit; `provenance.json` records both (kvbench puts it in every run's manifest). Where the Hub is
unreachable, it says what to do instead.
"""
from __future__ import annotations

import argparse
import json
import sys
import zipfile
from pathlib import Path

from pinning import resolve_revision, sha256_file, write_provenance

REPO_ID = "THUDM/LongBench"
URL = "https://huggingface.co/datasets/THUDM/LongBench/resolve/{revision}/data.zip"
# records per file (LongBench task.md; LongBench-E: the 0-4k + 4-8k + 8k+ counts of its README)
EXPECTED = {
    "narrativeqa": 200, "qasper": 200, "multifieldqa_en": 150, "multifieldqa_zh": 200, "hotpotqa": 200,
    "2wikimqa": 200, "musique": 200, "dureader": 200, "gov_report": 200, "qmsum": 200, "multi_news": 200,
    "vcsum": 200, "trec": 200, "triviaqa": 200, "samsum": 200, "lsht": 200, "passage_count": 200,
    "passage_retrieval_en": 200, "passage_retrieval_zh": 200, "lcc": 500, "repobench-p": 500,
    "qasper_e": 224, "multifieldqa_en_e": 150, "hotpotqa_e": 300, "2wikimqa_e": 300, "gov_report_e": 300,
    "multi_news_e": 294, "trec_e": 300, "triviaqa_e": 300, "samsum_e": 300, "passage_count_e": 300,
    "passage_retrieval_en_e": 300, "lcc_e": 300, "repobench-p_e": 300,
}


def fetch_zip(revision: str) -> Path:
    """data.zip from the Hub at `revision` (cached by huggingface_hub); SystemExit with a one-line hint when that
    fails."""
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(repo_id=REPO_ID, filename="data.zip", repo_type="dataset", revision=revision))
    except Exception as e:  # offline, firewalled, rate-limited, ...: all end the same way
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0]
        raise SystemExit(
            f"download_longbench: cannot fetch {REPO_ID} data.zip from the Hugging Face Hub ({reason[:160]}). "
            f"Run this script on a machine that reaches the Hub and copy the folder over, or download "
            f"{URL.format(revision=revision)} "
            f"by hand and run: python scripts/download_longbench.py --zip <path to data.zip>"
        ) from None


def unpack(zip_path: Path, root: Path, force: bool = False) -> dict[str, int]:
    """Write every `*.jsonl` of the zip flat into `root`; returns records per file stem."""
    root.mkdir(parents=True, exist_ok=True)
    counts: dict[str, int] = {}
    with zipfile.ZipFile(zip_path) as zf:
        members = [m for m in zf.infolist() if m.filename.endswith(".jsonl") and not m.is_dir()]
        if not members:
            raise SystemExit(f"download_longbench: {zip_path} holds no .jsonl files; is it LongBench's data.zip?")
        for m in members:
            target = root / Path(m.filename).name      # flat, and no path from the archive reaches the filesystem
            if target.exists() and not force:
                raise SystemExit(f"download_longbench: {target} exists; pass --force to overwrite.")
            data = zf.read(m)
            target.write_bytes(data)
            counts[target.stem] = sum(1 for line in data.splitlines() if line.strip())
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="data/longbench", help="output folder (default: data/longbench)")
    parser.add_argument("--zip", help="use this data.zip instead of downloading it")
    parser.add_argument("--force", action="store_true", help="overwrite existing files")
    parser.add_argument("--revision", default="main", help="Hub revision: branch, tag or commit (default: main)")
    args = parser.parse_args(argv)

    resolved = None if args.zip else resolve_revision(REPO_ID, args.revision)
    zip_path = Path(args.zip).expanduser() if args.zip else fetch_zip(resolved or args.revision)
    if not zip_path.is_file():
        raise SystemExit(f"download_longbench: {zip_path} is not a file.")
    root = Path(args.root).expanduser()
    counts = unpack(zip_path, root, args.force)
    source = {"repo": REPO_ID, "zip": str(zip_path), "zip_sha256": sha256_file(zip_path),
              "files": {stem: {"records": n, "sha256": sha256_file(root / f"{stem}.jsonl")}
                        for stem, n in sorted(counts.items())}}
    (root / "SOURCE.json").write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")
    write_provenance(root, REPO_ID, None if args.zip else args.revision, resolved, [zip_path],
                     zip=str(zip_path) if args.zip else None)
    missing = sorted(set(EXPECTED) - set(counts))
    odd = {s: (n, EXPECTED[s]) for s, n in counts.items() if s in EXPECTED and n != EXPECTED[s]}
    print(f"download_longbench: {len(counts)} files into {root}/ (zip sha256 {source['zip_sha256'][:16]}...)")
    if missing:
        print(f"download_longbench: warning: missing {', '.join(missing)}", file=sys.stderr)
    for stem, (n, expected) in sorted(odd.items()):
        print(f"download_longbench: warning: {stem}.jsonl has {n} records, LongBench lists {expected}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
