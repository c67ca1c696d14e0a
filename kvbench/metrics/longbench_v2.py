"""LongBench v2 scoring: the answer letter a response gives, and whether it is the right one.

`extract_answer` reads THUDM/LongBench `pred.py: extract_answer` (commit 2e00731, top level = LongBench v2): asterisks
removed first (markdown bold), then the first "The correct answer is (X)" with X in A-D; only if there is none, the
first "The correct answer is X"; otherwise no answer (None, judged wrong). pred.py strips the response before, and
the first match wins even if a later sentence names another letter.
`kvpress_match` reads kvpress's `evaluation/benchmarks/longbenchv2/calculate_metrics.py: score` (@ 8bb29b9), which
asks instead whether either phrase *with the expected letter* occurs anywhere, so a response naming two letters
counts as right when one of them is. tests/fixtures/longbench_v2_golden.json pins both on responses that tell them
apart (values computed by the reference functions themselves).
"""
from __future__ import annotations

import re

PARENTHESIZED = re.compile(r"The correct answer is \(([A-D])\)")
BARE = re.compile(r"The correct answer is ([A-D])")


def extract_answer(response: str) -> str | None:
    """The answer letter of a response, as pred.py reads it (see the module docstring); None: no answer."""
    text = response.strip().replace("*", "")
    for pattern in (PARENTHESIZED, BARE):
        found = pattern.search(text)
        if found:
            return found.group(1)
    return None


def kvpress_match(response: str, answer: str) -> bool:
    """kvpress's judge: "The correct answer is (<answer>)" or "The correct answer is <answer>" anywhere."""
    text = response.replace("*", "")
    return f"The correct answer is ({answer})" in text or f"The correct answer is {answer}" in text
