"""Summarization scorers of the seed papers, each computed the way its authors' code computed it.

- Keyformer (d-matrix-ai/keyformer-llm @ f327831, `summarization/summarize.py`): HF `evaluate`'s "rouge" metric
  (`rouge_score.RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"], use_stemmer=True)`) called with
  `use_aggregator=False`, i.e. one F-measure per sample, then `round(mean * 100, 4)` per key. Before scoring, the
  prediction has its newlines replaced by spaces (it went through a text file, one line per summary); prediction
  and reference are stripped and re-joined one `nltk.sent_tokenize` sentence per line (rougeLsum needs that).
  `evaluate`'s default aggregator is `BootstrapAggregator` (the bootstrap "mid" of 1000 resamples: random);
  Keyformer switched it off, and so do we: per-sample F-measures, averaged.
- BUZZ (JunqiZhao888/buzz-llm @ e6f5e3e): the `rouge` package (pltrdy, 1.0.1) on the driver's reconstructed
  output `res` = the decoded text, stripped, plus one trailing space; `Rouge().get_scores(res, ref, avg=True)`,
  F of rouge-1/2/l, averaged over samples. Case-sensitive, "."-split sentences, set-based n-grams. The package
  raises on an empty hypothesis, but `res` always ends with a space, so it never is empty: an empty generation
  scores 0.0 through the package itself. "Mean ROUGE" (BUZZ Table 2) is the geometric mean of the averaged
  R-1/R-2/R-L, computed over a set of samples, never per sample.
- BUZZ Self-BLEU (`run_bleu_eval.py`): the output is split on "." and each piece stripped (empty pieces stay); each
  piece, whitespace-tokenized, is scored by nltk's `sentence_bleu` (weights 1/3 each, `SmoothingFunction().method1`)
  against the other pieces of the same summary, and the values are averaged. With a single piece there is no
  reference and nltk raises (the driver crashed); we score it 0.0 (nothing repeats) and say so here.
"""
from __future__ import annotations

from functools import lru_cache

from kvbench.registry import METRICS

KEYFORMER_KEYS = ("rouge1", "rouge2", "rougeL", "rougeLsum")
BUZZ_KEYS = {"rouge-1": "rouge1", "rouge-2": "rouge2", "rouge-l": "rougeL"}


# --- Keyformer: evaluate's rouge (rouge_score, stemmed), no aggregator -------------------------------------------
@lru_cache(maxsize=1)
def _stemmed_scorer():
    from kvbench.metrics.nltk_import import import_nltk

    import_nltk()
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(rouge_types=list(KEYFORMER_KEYS), use_stemmer=True)


def keyformer_postprocess(text: str, is_prediction: bool) -> str:
    """summarize.py's path to the scorer: newlines -> spaces (predictions only), strip, one sentence per line."""
    from kvbench.metrics.sentences import sentence_splitter

    if is_prediction:
        text = text.replace("\n", " ")
    return "\n".join(sentence_splitter()(text.strip()))


def keyformer_rouge(prediction: str, reference: str) -> dict[str, float]:
    """Per-sample F-measures of rouge1/2/L/Lsum, as `evaluate.load("rouge").compute(..., use_stemmer=True,
    use_aggregator=False)` returns them for this pair (in [0, 1])."""
    pred = keyformer_postprocess(prediction, is_prediction=True)
    ref = keyformer_postprocess(reference, is_prediction=False)
    scores = _stemmed_scorer().score(ref, pred)  # rouge_score's order: (target, prediction)
    return {key: scores[key].fmeasure for key in KEYFORMER_KEYS}


def keyformer_table(per_sample: list[dict[str, float]]) -> dict[str, float]:
    """summarize.py's result: `round(np.mean(values) * 100, 4)` per key."""
    import numpy as np

    return {key: round(float(np.mean([s[key] for s in per_sample])) * 100, 4) for key in KEYFORMER_KEYS}


# --- BUZZ: pltrdy rouge on the driver's `res` --------------------------------------------------------------------
@lru_cache(maxsize=1)
def _pltrdy():
    from rouge import Rouge

    return Rouge()


def buzz_output(text: str) -> str:
    """What `my_inference_v3` returns for a decoded text: its space-separated words re-joined, plus a space."""
    return " ".join(text.strip().split(" ")) + " "


def buzz_rouge(prediction: str, reference: str) -> dict[str, float]:
    """`cal_rouge_score(res, ref)`: pltrdy `Rouge().get_scores(res, ref, avg=True)` F values (in [0, 1])."""
    scores = _pltrdy().get_scores(buzz_output(prediction), reference, avg=True)
    return {name: scores[key]["f"] for key, name in BUZZ_KEYS.items()}


def mean_rouge(r1: float, r2: float, rl: float) -> float:
    """BUZZ Table 2's "mean score": the geometric mean of (averaged) ROUGE-1, ROUGE-2 and ROUGE-L."""
    return (r1 * r2 * rl) ** (1 / 3) if min(r1, r2, rl) > 0 else 0.0


def self_bleu(prediction: str) -> float:
    """BUZZ's intra-summary Self-BLEU-3 of one output (see the module docstring); in [0, 1]."""
    from kvbench.metrics.nltk_import import import_nltk

    import_nltk()
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu

    pieces = [p.strip() for p in buzz_output(prediction).split(".")]
    if len(pieces) < 2:
        return 0.0
    weights = (1 / 3, 1 / 3, 1 / 3)
    smoothing = SmoothingFunction().method1
    values = []
    for i, piece in enumerate(pieces):
        others = [p.split() for j, p in enumerate(pieces) if j != i]
        values.append(sentence_bleu(others, piece.split(), weights=weights, smoothing_function=smoothing))
    return float(sum(values) / len(values))


@METRICS.register("keyformer_rouge2")
def keyformer_rouge2(prediction: str, references: list[str]) -> float:
    """ROUGE-2 F (rouge_score, stemmed, Keyformer's post-processing) against the first reference."""
    return keyformer_rouge(prediction, references[0])["rouge2"]


@METRICS.register("buzz_rouge1")
def buzz_rouge1(prediction: str, references: list[str]) -> float:
    """ROUGE-1 F of the pltrdy `rouge` package on BUZZ's output string, against the first reference."""
    return buzz_rouge(prediction, references[0])["rouge1"]


@METRICS.register("self_bleu")
def self_bleu_metric(prediction: str, references: list[str]) -> float:
    """BUZZ's intra-summary Self-BLEU-3 (references unused)."""
    return self_bleu(prediction)
