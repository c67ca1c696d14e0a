"""ZeroSCROLLS per-task metrics (arXiv 2305.14196, Table 1): ROUGE for the four summaries, F1 for Qasper, NarrativeQA
and MuSiQue, accuracy for QuALITY, exponential similarity for SpaceDigest, the concordance index for BookSumSort.

The official scorer is `metrics/zero_scrolls.py` in the Hub dataset tau/zero_scrolls, unreachable here; these
functions follow a public GitHub copy of its functions (found by text search, "copied from official repo"), and
tests/fixtures/zero_scrolls_golden.json holds values that copy computed (how: in that file). Each function scores one
prediction against one reference; `best_over_references` takes the max over a sample's references, as upstream's
`metric_max_over_ground_truths`. Quirks kept:
- F1/EM normalisation: lower case, punctuation and articles removed, whitespace collapsed, then `unidecode`
  (transliteration to ASCII; without the `unidecode` package, NFKD with non-ASCII dropped: equal for accented
  Latin letters, not for other scripts).
- QuALITY: the first standalone capital A-D of each text (`\\b[A-D]\\b`): "(B) The lake" reads B.
- SpaceDigest: the first "<number>%" of each text, 0.5 ** (|difference| / 10); a reference without one counts as 0 %,
  a prediction without one scores 0.
- BookSumSort: the integers of each text (anything but digits, spaces and commas dropped); a prediction that is not
  a permutation of the reference scores 0, else Harrell's concordance index of the two orders (lifelines'
  `concordance_index(gold positions, predicted positions)`; no ties can occur in a permutation).
- ROUGE (summaries): rouge-score's rouge1, rouge2, rougeL F-measures with the Porter stemmer; the task's score is the
  geometric mean of the three task means (`geometric_rouge`), so a sample's own `rouge_geo` is for reading only.
"""
from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from functools import lru_cache
from itertools import combinations

try:  # the reference's transliteration
    from unidecode import unidecode as _to_ascii
except ImportError:  # pragma: no cover - depends on the environment
    def _to_ascii(text: str) -> str:
        return unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")

PUNCTUATION = set(string.punctuation)
ARTICLES = re.compile(r"\b(a|an|the)\b")
LETTER = re.compile(r"\b[A-D]\b")
PERCENT = re.compile(r"\d+\.?\d*%")


def normalize(text: str) -> str:
    """Lower case, drop punctuation, drop articles, collapse whitespace, transliterate (in the reference's order)."""
    text = "".join(ch for ch in text.lower() if ch not in PUNCTUATION)
    return _to_ascii(" ".join(ARTICLES.sub(" ", text).split()))


def f1(prediction: str, reference: str) -> float:
    pred, ref = normalize(prediction).split(), normalize(reference).split()
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, reference: str) -> float:
    return float(normalize(prediction) == normalize(reference))


def accuracy(prediction: str, reference: str) -> float:
    """QuALITY: the first standalone A-D of each text must agree (the reference must have one)."""
    gold = LETTER.search(reference)
    if gold is None:
        raise ValueError(f"zero_scrolls: quality reference {reference!r:.60} names no letter A-D")
    found = LETTER.search(prediction)
    return float(found is not None and found.group() == gold.group())


def _percent(text: str) -> float | None:
    found = PERCENT.search(text)
    return None if found is None else float(found.group().rstrip("%"))


def exp_similarity(prediction: str, reference: str) -> float:
    gold, pred = _percent(reference), _percent(prediction)
    if pred is None:
        return 0.0
    return 0.5 ** (abs((gold or 0.0) - pred) / 10)


def _integers(text: str) -> list[int]:
    kept = re.sub(r"[^0-9\s,]", "", text).replace(",", " ").strip(string.punctuation).split()
    return [int(x) for x in kept]


def _positions(order: list[int]) -> list[int]:
    """Summary id per location -> the (1-based) location of each id."""
    where = [-1] * len(order)
    for location, summary_id in enumerate(order, 1):
        where[summary_id - 1] = location
    return where


def concordance(prediction: str, reference: str) -> float:
    pred, gold = _integers(prediction), _integers(reference)
    if sorted(pred) != sorted(gold):
        return 0.0
    if len(gold) < 2:
        raise ValueError(f"zero_scrolls: book_sum_sort reference {reference!r:.60} orders fewer than two summaries")
    gold_pos, pred_pos = _positions(gold), _positions(pred)
    pairs = list(combinations(range(len(gold)), 2))
    agree = sum((gold_pos[i] - gold_pos[j]) * (pred_pos[i] - pred_pos[j]) > 0 for i, j in pairs)
    return agree / len(pairs)


@lru_cache(maxsize=1)
def _rouge_scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)


def rouge(prediction: str, reference: str) -> dict[str, float]:
    """rouge1/rouge2/rougeL F-measures of one prediction against one reference."""
    scores = _rouge_scorer().score(reference, prediction)
    return {k: scores[k].fmeasure for k in ("rouge1", "rouge2", "rougeL")}


def geometric_rouge(means: dict[str, float]) -> float:
    """The summaries' task score: the geometric mean of the rouge1, rouge2 and rougeL means."""
    product = means["rouge1"] * means["rouge2"] * means["rougeL"]
    return product ** (1 / 3)


def best_over_references(fn, prediction: str, references: list[str]) -> float:
    return max(fn(prediction, r) for r in references)


SCORERS = {"f1": f1, "accuracy": accuracy, "exp_similarity": exp_similarity, "concordance_index": concordance}
