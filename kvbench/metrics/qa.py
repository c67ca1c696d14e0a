"""Open-domain QA scorers for 10-document QA (Lost in the Middle, as BUZZ ran it).

- `best_subspan_em`: nelson-liu/lost-in-the-middle @ 29b8a6d `src/lost_in_the_middle/metrics.py`: SQuAD
  normalisation (lower-case, drop ASCII punctuation, articles a/an/the -> space, collapse whitespace; the `regex`
  package's `\\b`), then 1.0 if any normalised gold answer is a substring of the normalised prediction.
  Its `scripts/evaluate_qa_responses.py` first keeps the prediction up to the first newline, stripped
  (`first_line`), so a model cannot score by copying the documents.
- `exact_match`: BUZZ's `run_ten_doc_qa_em.py: calc_em_score(predicted, answers[0])`, strict equality after
  strip + lower (its call is commented out upstream; with free generation it is near 0, kept for completeness).
"""
from __future__ import annotations

import string

import regex

from kvbench.registry import METRICS

_PUNCT = frozenset(string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD normalisation, in lost-in-the-middle's order: lower, punctuation, articles, whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    return " ".join(regex.sub(r"\b(a|an|the)\b", " ", s).split())


def first_line(prediction: str) -> str:
    """evaluate_qa_responses.py: `model_answer.split("\\n")[0].strip()`."""
    return prediction.split("\n")[0].strip()


@METRICS.register("best_subspan_em")
def best_subspan_em(prediction: str, references: list[str]) -> float:
    """1.0 if a normalised reference occurs in the normalised prediction (no first-line cut here)."""
    pred = normalize_answer(prediction).lower()
    return 1.0 if any(normalize_answer(r).lower() in pred for r in references) else 0.0


@METRICS.register("exact_match")
def exact_match(prediction: str, references: list[str]) -> float:
    """BUZZ's strict EM against the first reference: `predicted.strip().lower() == actual.strip().lower()`."""
    return 1.0 if prediction.strip().lower() == references[0].strip().lower() else 0.0
