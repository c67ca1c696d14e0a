"""Graders of the reasoning sets (issue 32): lm-eval's GSM8K filters and exact match, and math-verify.

- GSM8K (EleutherAI lm-evaluation-harness 0.4.13, `lm_eval/tasks/gsm8k/gsm8k.yaml` and `gsm8k-cot.yaml`): a filter
  pulls the answer out of the response, `RegexFilter` (`lm_eval/filters/extraction.py`: `re.findall`, the
  `group_select`-th match, a tuple of groups -> its first non-empty group, stripped; no match -> "[invalid]")
  then `take_first`; the metric is `exact_match_hf_evaluate` (`lm_eval/api/metrics.py`) with the task's
  `regexes_to_ignore` (each `re.sub(r, "", .)` in order, on prediction and reference), `ignore_case: true`,
  `ignore_punctuation: false`. The reference is the task's `doc_to_target`: the whole GSM8K answer for `gsm8k`
  (the "(?s).*#### " regex cuts it to the number), the text after "####", stripped, for `gsm8k_cot`.
  Two filters each: `strict_match` (gsm8k: "#### <n>"; gsm8k_cot: "The answer is <n>.") and `flexible_extract`
  (the last number-like string of the response). tests/unit/test_reasoning_graders.py runs lm-eval's own filter
  and `process_results` on the same responses.
- MATH-500, AIME: `math_verify.verify(parse(gold), parse(prediction))` (Hugging Face `math-verify`, pinned in
  pyproject.toml), called, not rewritten; the gold answer is wrapped in `$...$` first (math-verify's README form: a
  bare `p - q` or `11\\sqrt2` does not parse). `answered` is kvpress's count of responses holding "boxed{".
"""
from __future__ import annotations

import re
import threading

from kvbench.registry import METRICS

INVALID = "[invalid]"  # RegexFilter's fallback
GSM8K_IGNORE = (",", r"\$", "(?s).*#### ", r"\.$")  # exact_match's regexes_to_ignore, both tasks
STRICT = {"gsm8k": r"#### (\-?[0-9\.\,]+)", "gsm8k_cot": r"The answer is (\-?[0-9\.\,]+)."}
FLEXIBLE = r"(-?[$0-9.,]{2,})|(-?[0-9]+)"  # group_select -1: the last match


def regex_extract(text: str, pattern: str, group_select: int = 0, fallback: str = INVALID) -> str:
    """lm-eval's `RegexFilter` followed by `take_first`, for one response."""
    matches = re.findall(pattern, text)
    if not matches:
        return fallback
    match = matches[group_select]
    if isinstance(match, tuple):  # several groups: the first that matched
        match = next((m for m in match if m), fallback)
    return match.strip()


def exact_match(prediction: str, reference: str, regexes_to_ignore=GSM8K_IGNORE, ignore_case: bool = True) -> float:
    """lm-eval's `exact_match_hf_evaluate` on one pair, as the GSM8K tasks call it (no punctuation or number
    stripping there)."""
    for pattern in regexes_to_ignore:
        prediction, reference = re.sub(pattern, "", prediction), re.sub(pattern, "", reference)
    if ignore_case:
        prediction, reference = prediction.lower(), reference.lower()
    return float(prediction == reference)


def gsm8k_target(answer: str, protocol: str) -> str:
    """The task's `doc_to_target` on a GSM8K answer ("<reasoning>\\n#### <n>")."""
    return answer if protocol == "gsm8k" else answer.split("####")[-1].strip()


def gsm8k_scores(prediction: str, answer: str, protocol: str) -> dict[str, float]:
    """Both filters of the task, each through exact match against the task's target."""
    target = gsm8k_target(answer, protocol)
    return {"strict_match": exact_match(regex_extract(prediction, STRICT[protocol]), target),
            "flexible_extract": exact_match(regex_extract(prediction, FLEXIBLE, group_select=-1), target)}


@METRICS.register("gsm8k_strict_match")
def gsm8k_strict_match(prediction: str, references: list[str]) -> float:
    """lm-eval `gsm8k`, filter strict-match ("#### <n>"); `references[0]` is the GSM8K answer."""
    return gsm8k_scores(prediction, references[0], "gsm8k")["strict_match"]


@METRICS.register("gsm8k_cot_strict_match")
def gsm8k_cot_strict_match(prediction: str, references: list[str]) -> float:
    """lm-eval `gsm8k_cot`, filter strict-match ("The answer is <n>.")."""
    return gsm8k_scores(prediction, references[0], "gsm8k_cot")["strict_match"]


@METRICS.register("gsm8k_flexible_extract")
def gsm8k_flexible_extract(prediction: str, references: list[str]) -> float:
    """lm-eval `gsm8k` / `gsm8k_cot`, filter flexible-extract (the last number in the response)."""
    return gsm8k_scores(prediction, references[0], "gsm8k")["flexible_extract"]


@METRICS.register("math_verify")
def math_verify(prediction: str, references: list[str]) -> float:
    """1.0 if math-verify finds the prediction's answer equal to the gold `references[0]`:
    `verify(parse("$" + gold + "$"), parse(prediction))` with math-verify's defaults (LaTeX and plain expressions,
    \\boxed{} first; several boxes become a set; units and \\text dropped). math-verify times out through
    SIGALRM, which only the main thread may set: elsewhere the timeouts are off (its own advice)."""
    from math_verify import parse, verify  # sympy + antlr: imported on first use

    main = threading.current_thread() is threading.main_thread()
    parse_kw, verify_kw = ({}, {}) if main else ({"parsing_timeout": None}, {"timeout_seconds": None})
    gold = parse(f"${references[0]}$", **parse_kw)
    return float(verify(gold, parse(prediction, **parse_kw), **verify_kw))


@METRICS.register("answered")
def answered(prediction: str, references: list[str]) -> float:
    """kvpress's `answered` (evaluation/benchmarks/aime25, math500 `calculate_metrics`): "boxed{" in the response."""
    return float("boxed{" in prediction)
