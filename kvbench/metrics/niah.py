"""Needle-in-a-Haystack scorers: the variants the KV-cache papers used instead of Kamradt's GPT-4 judge.

References of a NIAH sample are `[needle, expected_phrase]` (see `kvbench.data.niah`): the needle is the sentence
that was inserted, the expected phrase is the part of it a correct answer must contain. ROUGE compares the
prediction with the needle; the recall and substring scorers compare it with the expected phrase. When the
references hold only a needle, the phrase falls back to PyramidKV's hard-coded one, as in `visualize.py`.

Values are on each reference's native scale: recalls and substring in [0, 1], `rouge1_f_x10` in [0, 10].
"""
from __future__ import annotations

from functools import lru_cache

from kvbench.registry import METRICS

PYRAMIDKV_EXPECTED = "eat a sandwich and sit in Dolores Park on a sunny day."


def expected_phrase(references: list[str]) -> str:
    """The expected answer phrase: `references[1]` when given, else PyramidKV's default."""
    return references[1] if len(references) > 1 else PYRAMIDKV_EXPECTED


def _words(text: str) -> list[str]:
    # visualize.py: lower-case, split on whitespace, keep punctuation attached ("day." != "day")
    return text.lower().split()


@METRICS.register("pyramidkv_recall")
def pyramidkv_recall(prediction: str, references: list[str]) -> float:
    """PyramidKV heatmap score (KVCache-Factory `scripts/scripts_needle/visualize.py`, the paper's "Acc." / 100).

    |set(pred words) ∩ set(expected words)| / |set(expected words)|; the default phrase has 11 unique words,
    so a perfect answer without the final period ("day" instead of "day.") scores 10/11.
    """
    expected = set(_words(expected_phrase(references)))
    return len(set(_words(prediction)) & expected) / len(expected)


@METRICS.register("franxyao_recall")
def franxyao_recall(prediction: str, references: list[str]) -> float:
    """FranxYao Long-Context-Data-Engineering `eval/needle/visualize.py`: the same intersection as
    `pyramidkv_recall` but divided by the word count *with* duplicates (12 for the default), so at most 11/12."""
    expected = _words(expected_phrase(references))
    return len(set(_words(prediction)) & set(expected)) / len(expected)


@lru_cache(maxsize=1)
def _rouge1_scorer():
    from kvbench.metrics.nltk_import import import_nltk

    import_nltk()  # (rouge_score imports nltk: without its optional scikit-learn / SciPy parts)
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rouge1"], use_stemmer=True)


@METRICS.register("rouge1_f_x10")
def rouge1_f_x10(prediction: str, references: list[str]) -> float:
    """The `score` PyramidKV's `run_needle_in_haystack.py` stores per cell (inherited from FranxYao):
    Google `rouge_score` ROUGE-1 F-measure with stemming, target = needle, prediction = response, times 10."""
    return _rouge1_scorer().score(references[0], prediction)["rouge1"].fmeasure * 10


@METRICS.register("substring")
def substring(prediction: str, references: list[str]) -> float:
    """1.0 if the expected phrase (period included) occurs in the prediction, case-insensitively; else 0.0.
    Not from a paper: a strict exact-retrieval check to read next to the word-recall scores."""
    return float(expected_phrase(references).lower() in prediction.lower())
