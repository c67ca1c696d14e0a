"""LooGLE's automatic metrics (bigai-nlco/LooGLE @ 6734382, `Evaluation/automatic_metrics.py`) and kvpress's reading
of them (NVIDIA/kvpress @ 8bb29b9, `evaluation/benchmarks/loogle/calculate_metrics.py`).

- BLEU-1 / BLEU-4: nltk's `sentence_bleu` (no smoothing) on whitespace tokens, newlines read as spaces.
- ROUGE-1 / ROUGE-2 / ROUGE-L: the `rouge` package (1.0.1, pinned for LongBench) `Rouge().get_scores`, the
  **recall** (`metric="r"`), as upstream. An empty hypothesis makes `rouge` raise: LooGLE's `automatic_eval.py` turns
  an empty prediction into "None" first; kvpress scores 0 for a metric that raises.
- Cloze (shortdep_cloze): the prediction is read as a Python dict literal; exact match counts the masks whose value
  equals the reference's, partial match those sharing at least one whitespace token with it; a task's score is
  sum(matches) / sum(masks), rounded to 4 places. Upstream reads the prediction with `eval()` (a model's output run
  as code); kvbench uses `ast.literal_eval`, equal for every literal and refusing anything else (e.g. `dict(a=1)`,
  which `eval` would accept). A prediction that is not a dict scores 0 of the reference's masks (kvpress counts 1
  mask for it in exact match: `kvpress=True`).
Not computed: METEOR (needs the WordNet corpus, not shipped with nltk, and upstream passes *sets* of words, whose
order, and so METEOR's fragmentation penalty, changes with Python's hash seed) and BERTScore (a roberta-large
download). tests/fixtures/loogle_golden.json holds values LooGLE's own functions computed.
"""
from __future__ import annotations

import ast
import warnings


def bleu(reference: str, hypothesis: str) -> dict[str, float]:
    from nltk.translate.bleu_score import sentence_bleu

    ref, hyp = reference.replace("\n", " ").split(), hypothesis.replace("\n", " ").split()
    with warnings.catch_warnings():  # nltk warns at every answer without 4-gram overlap (BLEU-4 = 0, as intended)
        warnings.simplefilter("ignore", UserWarning)
        return {"bleu1": float(sentence_bleu([ref], hyp, weights=(1, 0, 0, 0))),
                "bleu4": float(sentence_bleu([ref], hyp, weights=(0, 0, 0, 1)))}


def rouge_recall(reference: str, hypothesis: str) -> dict[str, float]:
    from rouge import Rouge

    scores = Rouge().get_scores(hyps=[hypothesis], refs=[reference])[0]
    return {"rouge1": scores["rouge-1"]["r"], "rouge2": scores["rouge-2"]["r"], "rougeL": scores["rouge-l"]["r"]}


def generation_scores(reference: str, prediction: str) -> dict[str, float]:
    """BLEU and ROUGE of one answer; an empty prediction reads "None" (automatic_eval.py); a metric that raises
    scores 0 (kvpress's `try_except_metric`)."""
    hypothesis = prediction if prediction != "" else "None"
    out = {}
    for fn, keys in ((bleu, ("bleu1", "bleu4")), (rouge_recall, ("rouge1", "rouge2", "rougeL"))):
        try:
            out.update(fn(reference, hypothesis))
        except Exception:  # noqa: BLE001 - rouge's "Hypothesis is empty" (a prediction of only dots, ...)
            out.update({k: 0.0 for k in keys})
    return out


def read_dict(text: str) -> dict | None:
    """A Python dict literal, or None (not a literal, or not a dict)."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def cloze_matches(reference: dict, prediction: str, kvpress: bool = False) -> tuple[int, int, int, int]:
    """(exact matches, masks counted for exact, partial matches, masks counted for partial)."""
    hypothesis = read_dict(prediction)
    count = len(reference)
    if hypothesis is None:
        return 0, (1 if kvpress else count), 0, count
    exact = sum(1 for key, value in reference.items() if key in hypothesis and hypothesis[key] == value)
    partial = 0
    for key in reference:
        if key in hypothesis:
            gold, guess = set(str(reference[key]).split()), hypothesis[key]
            if not isinstance(guess, str):  # upstream calls .split() on it: an error, caught as a failed read
                return exact, count, 0, count
            partial += int(len(gold & set(guess.split())) > 0)
    return exact, count, partial, count
