"""InfiniteBench scorers: `src/compute_scores.py` of OpenBMB/InfiniteBench @ 88b3daa (`official`), and the variant
TailorKV's `infinitebench/compute_scores.py` (ydyhello/TailorKV @ 4e9fc81) scored its Table 15 with (`tailorkv`).

`score_one(task, prediction, label, scorer)` returns upstream's per-sample value as a float (booleans as 0/1); a
task's score is the plain mean over its samples (upstream `get_score`). `label` is upstream's `get_answer(eg)`: the
record's `answer` (a list for most tasks; an int or float for math_find), or `[answer text, letter]` for
code_debug and longbook_choice_eng. Where the TailorKV copy differs from the official file:
- code_debug: a first pass takes the last stand-alone capital letter A-J (regex `\\b[A-J]\\b(?!.*\\b[A-J]\\b)`)
  and accepts it if it is the right option; the cleaned prediction also counts if it starts with the letter or the
  function name; the official file only accepts "X." / "X:" at the start, then the answer prefixes.
- longbook_choice_eng: the same last-letter regex (A-D) first, then the official rules.
- longdialogue_qa_eng: any label, upper-cased, as a substring of the upper-cased prediction (official: the first
  label must be one of the prediction's words after punctuation is blanked).
- math_find: an int label is compared with `int(float(first number))` (official: `int(first number)`, which
  raises on "3.5"; upstream would crash, here such a prediction scores 0.0).
- kv_retrieval: a list label is unwrapped first (official compares the list itself).
longbook_sum_eng: `evaluate`'s rouge without stemming, `use_aggregator=False`, rougeLsum F (rouge_score 0.1.2).
"""
from __future__ import annotations

import re
import string
from collections import Counter
from functools import lru_cache

from kvbench.metrics.longbench import normalize_zh_answer

SCORERS = ("official", "tailorkv")
_PUNCT = frozenset(string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD normalisation with `re` (compute_scores.py's own copy)."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def _f1(pred: list, truth: list) -> float:
    same = sum((Counter(pred) & Counter(truth)).values())
    if same == 0:
        return 0
    p, r = same / len(pred), same / len(truth)
    return 2 * p * r / (p + r)


def qa_f1(pred: str, truths: list[str]) -> float:
    return max([0] + [_f1(normalize_answer(pred).split(), normalize_answer(t).split()) for t in truths])


def qa_f1_zh(pred: str, truths: list[str]) -> float:
    return max([0] + [_f1(list(normalize_zh_answer(pred)), list(normalize_zh_answer(t))) for t in truths])


def first_int(pred: str) -> str:
    """The first run of digits ("" if none), as `first_int_match`."""
    return next((part for part in re.split("[^0-9]", pred) if part != ""), "")


def _blank(pred: str, chars) -> str:
    for c in chars:
        pred = pred.replace(c, " ")
    return pred


def _squeeze(pred: str) -> str:
    while "  " in pred:
        pred = pred.replace("  ", " ")
    return pred


_RETRIEVAL_CHARS = ["\n", ":", '"', "'", ".", ",", "?", "!", "{", "}"]


def _first(label):
    return label[0] if isinstance(label, list) else label


def kv_retrieval(pred: str, label, scorer: str) -> bool:
    if scorer == "tailorkv":
        label = _first(label)
    return label in _blank(pred, _RETRIEVAL_CHARS).split()


def passkey(pred: str, label, scorer: str) -> bool:  # also number_string
    return _first(label) == first_int(pred)


def _after_prefix(pred: str, prefixes: tuple[str, ...], options) -> bool | None:
    """The official scorers' answer-after-a-cue rule: at the first cue found (in `prefixes` order), whether the text
    one character after it starts with an option; None when no cue occurs."""
    for prefix in prefixes:
        idx = pred.find(prefix)
        if idx == -1:
            continue
        if len(pred) < idx + len(prefix) + 1:
            return False
        return any(pred[idx + len(prefix) + 1:].startswith(o) for o in options)
    return None


def code_debug(pred: str, label, scorer: str) -> bool:
    pred = pred.strip()
    letter, fn_name = label[1], label[0]
    if scorer == "tailorkv":
        match = re.search(r"\b[A-J]\b(?!.*\b[A-J]\b)", pred)
        if match and match.group(0) == letter:
            return True
    elif pred[:2] in (f"{letter}.", f"{letter}:"):
        return True
    pred = _squeeze(_blank(pred.strip(), ["\n", "`", "'", '"', "-", "*", "Option", "option"]))
    if scorer == "tailorkv" and (pred.startswith(letter) or pred.startswith(fn_name)):
        return True
    return bool(_after_prefix(pred, ("answer is:", "is:", "answer:", "correct option is:"), (letter, fn_name)))


def math_find(pred: str, label, scorer: str) -> bool:
    label = _first(label)
    match = re.search(r"\d+\.\d+|\d+", pred)
    if match is None:
        return False
    number = match.group(0).strip()
    if isinstance(label, bool) or not isinstance(label, (int, float)):
        raise TypeError(f"infinitebench: math_find expects an int or float label, got {type(label).__name__}")
    if isinstance(label, int):
        if scorer == "tailorkv":
            return int(float(number)) == label
        return number.isdigit() and int(number) == label  # int("3.5") raised upstream: scored 0 here
    return float(number) == label


def longdialogue_qa_eng(pred: str, label, scorer: str) -> bool:
    if scorer == "tailorkv":
        pred = pred.strip().upper()
        return any(item.upper() in pred for item in label)
    words = [w.upper() for w in _blank(pred.strip(), _RETRIEVAL_CHARS).split()]
    return label[0] in words


def longbook_choice_eng(pred: str, label, scorer: str) -> bool:
    pred = pred.strip()
    if scorer == "tailorkv":
        match = re.search(r"\b[A-D]\b(?!.*\b[A-D]\b)", pred)
        if match and match.group(0) in label:
            return True
    if pred == "":
        return False
    if pred[0] in "ABCD":
        return pred[0] in label
    if pred in label:
        return True
    pred = _squeeze(_blank(pred, ["\n", '"', "'", ".", ",", "?", "!", "{", "}"]))
    found = _after_prefix(pred, ("answer is:", "answer:", "answer is", "option is"), label)
    if found is not None:
        return found
    for word in pred.split():
        if word in "ABCD":
            return word in label
    return False


@lru_cache(maxsize=1)
def _rouge_lsum():
    from kvbench.metrics.nltk_import import import_nltk

    import_nltk()
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(rouge_types=["rouge1", "rouge2", "rougeL", "rougeLsum"], use_stemmer=False)


def longbook_sum_eng(pred: str, label, scorer: str) -> float:
    """evaluate's rouge on ([pred], [label]): a list label is a multi-reference (max F over references)."""
    references = label if isinstance(label, list) else [label]
    return _rouge_lsum().score_multi(references, pred)["rougeLsum"].fmeasure


def math_calc(pred: str, label, scorer: str) -> float:
    if isinstance(label[0], list):
        label = label[0]
    nums = [int(part) for part in re.split("[^0-9]", pred) if part != ""]
    count = 0
    for i, value in enumerate(label):
        if i >= len(nums) or value != nums[i]:
            break
        count += 1
    return count / len(label)


def code_run(pred: str, label, scorer: str) -> bool:
    label = _first(label)
    words = _blank(pred.strip(), ["\n", ".", "`", "'", '"', ":"]).split()
    if not words:
        return False
    try:
        return label == int(words[-1])
    except ValueError:
        return False


SCORE_ONE = {
    "passkey": passkey, "number_string": passkey, "kv_retrieval": kv_retrieval,
    "longdialogue_qa_eng": longdialogue_qa_eng, "longbook_sum_eng": longbook_sum_eng,
    "longbook_choice_eng": longbook_choice_eng, "longbook_qa_eng": lambda p, l, s: qa_f1(p, l),
    "longbook_qa_chn": lambda p, l, s: qa_f1_zh(p, l), "math_find": math_find, "math_calc": math_calc,
    "code_run": code_run, "code_debug": code_debug,
}


def score_one(task: str, prediction: str, label, scorer: str = "official") -> float:
    """Upstream `get_score_one(pred, label, task)` as a float in [0, 1]."""
    return float(SCORE_ONE[task](prediction, label, scorer))
