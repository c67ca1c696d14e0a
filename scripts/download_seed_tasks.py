"""Download the seed papers' evaluation data into the local folders kvbench reads (needs the Hugging Face Hub, and
github.com for Lost in the Middle). Each source keeps its own field names.

    python scripts/download_seed_tasks.py cnn_dailymail xsum wikitext_ppl lost_in_the_middle infinitebench
    python scripts/download_seed_tasks.py cnn_dailymail --out data --cnn-config 2.0.0   # BUZZ's config

Writes data/<name>/...: cnn_dailymail/validation.jsonl (abisee/cnn_dailymail, 3.0.0 = Keyformer's; 2.0.0 = BUZZ's,
same articles), xsum/validation.jsonl (EdinburghNLP/xsum), wikitext_ppl/validation.jsonl (wikitext,
wikitext-2-raw-v1, every row), lost_in_the_middle/nq-open-10_total_documents_gold_at_{0,4,9}.jsonl.gz
(nelson-liu/lost-in-the-middle @ main, qa_data/10_total_documents/), infinitebench/{task}.jsonl
(xinrongzhang2022/InfiniteBench, the files its scripts/download_dataset.sh fetches).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import urllib.request
from pathlib import Path

LITM_URL = ("https://github.com/nelson-liu/lost-in-the-middle/raw/main/qa_data/10_total_documents/"
            "nq-open-10_total_documents_gold_at_{k}.jsonl.gz")
INFINITEBENCH_TASKS = ("passkey", "number_string", "longdialogue_qa_eng", "longbook_sum_eng", "longbook_choice_eng",
                       "longbook_qa_eng", "longbook_qa_chn", "math_find", "code_debug", "kv_retrieval", "math_calc",
                       "code_run")


def write_jsonl(rows, path: Path, fields: tuple[str, ...]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({k: row[k] for k in fields}, ensure_ascii=False) + "\n")
    print(f"wrote {path}")


def hub_split(name: str, config: str | None, split: str):
    from datasets import load_dataset

    return load_dataset(name, config, split=split)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="+", choices=["cnn_dailymail", "xsum", "wikitext_ppl", "lost_in_the_middle",
                                                      "infinitebench"])
    parser.add_argument("--out", default="data", help="parent folder (default: data)")
    parser.add_argument("--split", default="validation")
    parser.add_argument("--cnn-config", default="3.0.0", help="abisee/cnn_dailymail config (BUZZ: 2.0.0)")
    args = parser.parse_args()
    out = Path(args.out)
    for name in args.names:
        if name == "cnn_dailymail":
            write_jsonl(hub_split("abisee/cnn_dailymail", args.cnn_config, args.split),
                        out / name / f"{args.split}.jsonl", ("id", "article", "highlights"))
        elif name == "xsum":
            write_jsonl(hub_split("EdinburghNLP/xsum", None, args.split), out / name / f"{args.split}.jsonl",
                        ("id", "document", "summary"))
        elif name == "wikitext_ppl":
            write_jsonl(hub_split("wikitext", "wikitext-2-raw-v1", args.split), out / name / f"{args.split}.jsonl",
                        ("text",))
        elif name == "lost_in_the_middle":
            (out / name).mkdir(parents=True, exist_ok=True)
            for k in (0, 4, 9):
                target = out / name / Path(LITM_URL.format(k=k)).name
                with urllib.request.urlopen(LITM_URL.format(k=k)) as response, open(target, "wb") as f:
                    shutil.copyfileobj(response, f)
                print(f"wrote {target}")
        else:
            from huggingface_hub import hf_hub_download

            for task in INFINITEBENCH_TASKS:
                path = hf_hub_download("xinrongzhang2022/InfiniteBench", f"{task}.jsonl", repo_type="dataset")
                (out / name).mkdir(parents=True, exist_ok=True)
                shutil.copy(path, out / name / f"{task}.jsonl")
                print(f"wrote {out / name / f'{task}.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
