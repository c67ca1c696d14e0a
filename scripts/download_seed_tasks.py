"""Download the seed papers' evaluation data into the local folders kvbench reads (needs the Hugging Face Hub, and
github.com for Lost in the Middle). Each source keeps its own field names.

    python scripts/download_seed_tasks.py cnn_dailymail xsum wikitext_ppl lost_in_the_middle infinitebench
    python scripts/download_seed_tasks.py infinitebench --revision <commit>     # pin a source (one source per call)
    python scripts/download_seed_tasks.py cnn_dailymail --cnn-config 2.0.0       # BUZZ's config (the same records)

Sources, each read at a revision (`--revision` replaces the default for every source named):
- cnn_dailymail/validation.jsonl: abisee/cnn_dailymail, config 3.0.0 (Keyformer's; BUZZ's `run_bleu_eval.py`
  loads 2.0.0), main.
- xsum/validation.jsonl: EdinburghNLP/xsum's parquet export, the branch refs/convert/parquet, files
  `default/<split>/*.parquet` (the repo's main holds a loading script, which `datasets` >= 4 refuses).
- wikitext_ppl/validation.jsonl: Salesforce/wikitext (the old id `wikitext` redirects there), wikitext-2-raw-v1,
  every row, main.
- lost_in_the_middle/nq-open-10_total_documents_gold_at_{0,4,9}.jsonl.gz: github nelson-liu/lost-in-the-middle @
  29b8a6d (HEAD; the 10-document files were re-uploaded in 30b4783, 2024-01-03), qa_data/10_total_documents/.
- infinitebench/{task}.jsonl: xinrongzhang2022/InfiniteBench, the files its scripts/download_dataset.sh fetches,
  main (files were re-uploaded in 2024: pin a commit to compare runs).
A branch is resolved to its commit first and the data are read at that commit; each folder gets provenance.json
(source, config, split, the revision asked for and the commit read, rows, each file's sha256, time), which kvbench
puts in every run's manifest (`dataset_provenance`).

CNN/DailyMail's configs: the dataset card says 1.0.0 and 2.0.0 were "preprocessed to replace named entities", but the
Hub's builder (huggingface/datasets `datasets/cnn_dailymail/cnn_dailymail.py`, whose output the Hub's parquet files
were converted from) builds all three configs from the same non-anonymized story files: 1.0.0 joins the highlights
with spaces, 2.0.0 and 3.0.0 with newlines (its dataset_infos.json gives every config the same bytes per split). The
card's sentence describes the original releases (Hermann et al., Nallapati et al.), not these configs, so BUZZ's
2.0.0 and Keyformer's 3.0.0 are the same records.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import urllib.request
from pathlib import Path
from typing import Iterable, NamedTuple
from urllib.parse import quote

from pinning import resolve_github, resolve_revision, write_jsonl, write_provenance


class HubSource(NamedTuple):
    repo: str
    config: str | None
    fields: tuple[str, ...]            # written in this order; every one is required
    revision: str = "main"             # default revision
    parquet: str | None = None         # a parquet export's files of one split ("{split}" filled in), read as such


HUB_SOURCES = {
    "cnn_dailymail": HubSource("abisee/cnn_dailymail", "3.0.0", ("id", "article", "highlights")),
    "xsum": HubSource("EdinburghNLP/xsum", None, ("id", "document", "summary"), "refs/convert/parquet",
                      "default/{split}/*.parquet"),
    "wikitext_ppl": HubSource("Salesforce/wikitext", "wikitext-2-raw-v1", ("text",)),
}
LITM_REPO = "nelson-liu/lost-in-the-middle"
LITM_COMMIT = "29b8a6d042ce29abccee3db1a73171a107d7e6af"
LITM_URL = ("https://github.com/{repo}/raw/{ref}/qa_data/10_total_documents/"
            "nq-open-10_total_documents_gold_at_{k}.jsonl.gz")
INFINITEBENCH_REPO = "xinrongzhang2022/InfiniteBench"
INFINITEBENCH_TASKS = ("passkey", "number_string", "longdialogue_qa_eng", "longbook_sum_eng", "longbook_choice_eng",
                       "longbook_qa_eng", "longbook_qa_chn", "math_find", "code_debug", "kv_retrieval", "math_calc",
                       "code_run")


# --- reading the Hub (the functions tests replace: no network there) ----------------------------------------------
def hub_base(repo: str, revision: str) -> str:
    """Where `datasets` reads a Hub dataset's files at a revision (special refs such as refs/convert/parquet as is)."""
    return f"hf://datasets/{repo}@{revision if revision.startswith('refs/') else quote(revision, safe='')}"


def load_rows(source: HubSource, split: str, revision: str) -> Iterable[dict]:
    """One split's rows at `revision`: a parquet export's files through the parquet builder (no loading script
    runs), any other source through its own configs."""
    from datasets import load_dataset

    if source.parquet is not None:
        files = f"{hub_base(source.repo, revision)}/{source.parquet.format(split=split)}"
        return load_dataset("parquet", data_files={split: files}, split=split)
    return load_dataset(source.repo, source.config, split=split, revision=revision)


def hub_file(repo: str, filename: str, revision: str) -> str:
    from huggingface_hub import hf_hub_download

    return hf_hub_download(repo, filename, repo_type="dataset", revision=revision)


def fetch_url(url: str, target: Path) -> None:
    with urllib.request.urlopen(url) as response, open(target, "wb") as f:
        shutil.copyfileobj(response, f)


# --- one folder per source ----------------------------------------------------------------------------------------


def download_hub(name: str, source: HubSource, out: Path, split: str, revision: str) -> None:
    resolved = resolve_revision(source.repo, revision)
    where = f"{source.repo}@{resolved or revision}:{split}"
    path = out / name / f"{split}.jsonl"
    rows = write_jsonl(load_rows(source, split, resolved or revision), path, source.fields, where,
                       "download_seed_tasks")
    extra = {"data_files": source.parquet.format(split=split)} if source.parquet else {}
    write_provenance(out / name, source.repo, revision, resolved, [path], config=source.config,
                     splits={split: split}, rows={split: rows}, **extra)


def download_infinitebench(out: Path, revision: str) -> None:
    resolved = resolve_revision(INFINITEBENCH_REPO, revision)
    (out / "infinitebench").mkdir(parents=True, exist_ok=True)
    written = []
    for task in INFINITEBENCH_TASKS:
        target = out / "infinitebench" / f"{task}.jsonl"
        shutil.copy(hub_file(INFINITEBENCH_REPO, f"{task}.jsonl", resolved or revision), target)
        written.append(target)
        print(f"wrote {target}")
    write_provenance(out / "infinitebench", INFINITEBENCH_REPO, revision, resolved, written)


def download_litm(out: Path, ref: str) -> None:
    resolved = resolve_github(LITM_REPO, ref)
    (out / "lost_in_the_middle").mkdir(parents=True, exist_ok=True)
    written = []
    for k in (0, 4, 9):
        url = LITM_URL.format(repo=LITM_REPO, ref=resolved or ref, k=k)
        target = out / "lost_in_the_middle" / Path(url).name
        fetch_url(url, target)
        written.append(target)
        print(f"wrote {target}")
    write_provenance(out / "lost_in_the_middle", f"github:{LITM_REPO}", ref, resolved, written,
                     path="qa_data/10_total_documents")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="+", choices=[*HUB_SOURCES, "lost_in_the_middle", "infinitebench"])
    parser.add_argument("--out", default="data", help="parent folder (default: data)")
    parser.add_argument("--split", default="validation")
    parser.add_argument("--revision", default=None,
                        help="branch, tag or commit for every source named (default: each source's: main; xsum "
                             f"refs/convert/parquet; lost_in_the_middle {LITM_COMMIT[:7]})")
    parser.add_argument("--cnn-config", default="3.0.0", choices=["1.0.0", "2.0.0", "3.0.0"],
                        help="abisee/cnn_dailymail config (Keyformer 3.0.0, BUZZ 2.0.0: the same records)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    for name in args.names:
        if name in HUB_SOURCES:
            source = HUB_SOURCES[name]
            if name == "cnn_dailymail":
                source = source._replace(config=args.cnn_config)
            download_hub(name, source, out, args.split, args.revision or source.revision)
        elif name == "lost_in_the_middle":
            download_litm(out, args.revision or LITM_COMMIT)
        else:
            download_infinitebench(out, args.revision or "main")
    return 0


if __name__ == "__main__":
    sys.exit(main())
