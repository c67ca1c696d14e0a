"""RULER's scorers, as `scripts/eval/evaluate.py` and `scripts/eval/synthetic/constants.py` (NVIDIA/RULER c5341b4).

Upstream scores a task in one call over all predictions: `round(100 * mean(per-sample value), 2)`, with per-sample
value `string_match_all` = the fraction of references found in the prediction and `string_match_part` = 1 if any is
found (case-insensitive substring tests, after `postprocess`). The registered per-sample functions return that
value in [0, 1]; `task_score` reproduces the batched call with its rounding.
"""
from __future__ import annotations

import re

from kvbench.registry import METRICS

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(prediction: str) -> str:
    """`evaluate.py: postprocess_pred`: strip, turn every control character into "\\n", strip again."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


@METRICS.register("string_match_all")
def string_match_all(prediction: str, references: list[str]) -> float:
    """Fraction of the references that occur in the prediction, ignoring case (RULER niah, vt, cwe, fwe)."""
    pred = prediction.lower()
    return sum(1.0 if r.lower() in pred else 0.0 for r in references) / len(references)


@METRICS.register("string_match_part")
def string_match_part(prediction: str, references: list[str]) -> float:
    """1.0 if any reference occurs in the prediction, ignoring case, else 0.0 (RULER qa_1, qa_2)."""
    pred = prediction.lower()
    return max(1.0 if r.lower() in pred else 0.0 for r in references)


def task_score(metric: str, predictions: list[str], references: list[list[str]]) -> float:
    """A task's score exactly as upstream's batched metric computes it: the sum of per-sample values over the count,
    times 100, rounded to 2 decimals. Predictions are taken as already postprocessed."""
    if not predictions:
        raise ValueError("ruler: task_score needs at least one prediction")
    fn = {"string_match_all": string_match_all, "string_match_part": string_match_part}[metric]
    return round(sum(fn(p, r) for p, r in zip(predictions, references)) / len(predictions) * 100, 2)
