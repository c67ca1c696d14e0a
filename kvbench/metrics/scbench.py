"""SCBench's per-turn scorers (microsoft/MInference @ fb56c91, `scbench/compute_scores.py`), for the six tasks kvbench
builds. Upstream maps each task to a scorer (`Multiturnbench_to_Infinitebench`, `NAME_TO_SCORE_GETTER`):

| task                    | upstream scorer                      | label (`get_ground_truth`) | here               |
|-------------------------|--------------------------------------|----------------------------|--------------------|
| scbench_kv              | get_score_one_kv_retrieval           | the answer string          | `kv_retrieval`     |
| scbench_prefix_suffix   | get_score_one_kv_retrieval           | the answer string          | `kv_retrieval`     |
| scbench_qa_eng          | get_score_one_longdialogue_qa_eng    | [answer]                   | `any_label_in`     |
| scbench_choice_eng      | get_score_one_longbook_choice_eng    | [answer, letter]           | `choice`           |
| scbench_many_shot       | get_score_one_longdialogue_qa_eng    | the answer string          | `any_label_in`     |
| scbench_summary         | get_score_one_longbook_sum_eng       | the answer string          | `rouge_lsum`       |

Quirks kept (scorer `official`, the default):
- kv_retrieval is a plain substring test on the raw prediction (`label in pred`), unlike InfiniteBench's word match.
- qa_eng is scored by containment (any label, upper-cased, inside the stripped, upper-cased prediction), not by F1.
- many_shot hands that same function a *string* label, so it iterates over the label's characters: a prediction
  scores 1 if it contains any one character of the answer (e.g. "(" of "(A)"). `scorer=strict` treats the string as
  one label instead (a kvbench switch, not upstream's).
- summary: HF `evaluate`'s "rouge" with its defaults (rouge_score 0.1.2, no stemmer, `use_aggregator=False`), the
  rougeLsum F-measure of this one pair; rougeLsum splits both texts at newlines (no sentence splitter).
A turn's score is in [0, 1]; upstream reports 100 x the mean per turn (`compute_scores`: `acc_by_turns`).
"""
from __future__ import annotations

from functools import lru_cache

from kvbench.metrics.infinitebench import longbook_choice_eng

SCORERS = ("official", "strict")


def kv_retrieval(pred: str, label: str) -> float:
    """`get_score_one_kv_retrieval`: the answer occurs in the prediction, verbatim."""
    return float(label in pred)


def any_label_in(pred: str, label) -> float:
    """`get_score_one_longdialogue_qa_eng`: 1 if any item of `label`, upper-cased, occurs in the stripped, upper-cased
    prediction. A str `label` is iterated character by character, as upstream does for many_shot."""
    pred = pred.strip().upper()
    return float(any(item.upper() in pred for item in label))


def choice(pred: str, label: list) -> float:
    """`get_score_one_longbook_choice_eng` (the same function as InfiniteBench's official one): the first letter,
    then the answer text itself, then an answer cue ("answer is:", ...), then the first stand-alone A-D."""
    return float(longbook_choice_eng(pred, label, "official"))


@lru_cache(maxsize=1)
def _rouge():
    from rouge_score import rouge_scorer

    # evaluate's rouge: RougeScorer(rouge_types=[rouge1, rouge2, rougeL, rougeLsum], use_stemmer=False)
    return rouge_scorer.RougeScorer(["rougeLsum"], use_stemmer=False)


def rouge_lsum(pred: str, label: str) -> float:
    """`get_score_one_longbook_sum_eng`: evaluate's rouge on ([pred], [label]) without aggregation, rougeLsum F."""
    return _rouge().score(label, pred)["rougeLsum"].fmeasure  # rouge_score's order: (target, prediction)


SCORE_TURN = {"scbench_kv": kv_retrieval, "scbench_prefix_suffix": kv_retrieval, "scbench_qa_eng": any_label_in,
              "scbench_choice_eng": choice, "scbench_many_shot": any_label_in, "scbench_summary": rouge_lsum}


def ground_truth(task: str, turn: dict):
    """Upstream `get_ground_truth` for one turn: [answer, letter] for choice_eng, [answer] for qa_eng, else the answer."""
    if task == "scbench_choice_eng":
        return [turn["answer"], "ABCD"[turn["options"].index(turn["answer"])]]
    if task == "scbench_qa_eng":
        return [turn["answer"]]
    return turn["answer"]


def score_turn(task: str, prediction: str, label, scorer: str = "official") -> float:
    """One turn's score in [0, 1], as upstream's `get_score_one(pred, label, task)`."""
    if scorer == "strict" and task == "scbench_many_shot" and isinstance(label, str):
        label = [label]
    return float(SCORE_TURN[task](prediction, label))
