"""NIAH scorers pinned on the values verified against PyramidKV / FranxYao (specs/anchor-benchmarks.md §3.3)."""
from __future__ import annotations

import pytest

from kvbench.metrics import METRICS
from kvbench.metrics.niah import PYRAMIDKV_EXPECTED, franxyao_recall, pyramidkv_recall, rouge1_f_x10, substring

NEEDLE = "\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\n"
REFS = [NEEDLE, PYRAMIDKV_EXPECTED]
PERFECT = "eat a sandwich and sit in Dolores Park on a sunny day."


def test_registered():
    for name in ("pyramidkv_recall", "franxyao_recall", "rouge1_f_x10", "substring"):
        assert name in METRICS


def test_perfect_answer_golden_values():
    assert round(rouge1_f_x10(PERFECT, REFS), 3) == 7.273   # 2 * 12 / (12 + 21) * 10
    assert pyramidkv_recall(PERFECT, REFS) == 1.0
    assert round(franxyao_recall(PERFECT, REFS), 3) == 0.917  # 11 unique / 12 words
    assert substring(PERFECT, REFS) == 1.0


def test_missing_final_period_costs_one_word():
    no_period = "Eat a sandwich and sit in Dolores Park on a sunny day"
    assert round(pyramidkv_recall(no_period, REFS), 3) == 0.909  # "day" != "day."
    assert substring(no_period, REFS) == 0.0


def test_punctuation_and_case():
    assert pyramidkv_recall("EAT A SANDWICH", REFS) == pytest.approx(3 / 11)
    assert pyramidkv_recall("park, sunny", REFS) == pytest.approx(1 / 11)   # "park," does not match "park"
    assert substring("The answer: Eat a sandwich and sit in dolores park on a sunny day. Yes", REFS) == 1.0
    assert pyramidkv_recall("", REFS) == 0.0 and rouge1_f_x10("", REFS) == 0.0


def test_needle_only_references_fall_back_to_pyramidkv_phrase():
    assert pyramidkv_recall(PERFECT, [NEEDLE]) == 1.0
    assert round(franxyao_recall(PERFECT, [NEEDLE]), 3) == 0.917


def test_other_needle_uses_its_own_phrase():
    refs = ["\nThe secret code is blue lantern seven.\n", "blue lantern seven."]
    assert pyramidkv_recall("It is blue lantern seven.", refs) == 1.0
    assert pyramidkv_recall(PERFECT, refs) == 0.0
    assert substring("BLUE LANTERN SEVEN.", refs) == 1.0
