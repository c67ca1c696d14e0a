"""tests/unit/decidable.py, the comparison every golden kept-set test rests on, on hand-worked selections: ties at
the cut go either way, anything decidable that differs fails."""
from __future__ import annotations

import torch

from tests.unit.decidable import mask, row_disagreements, threshold_disagreements, topk_disagreements

SCORES = torch.tensor([3.0, 2.0, 2.0, 1.0])  # top-2: entry 0, then one of the tied 1 and 2


def test_a_tie_at_the_cut_goes_either_way():
    assert topk_disagreements(SCORES, mask({0, 1}, 4), mask({0, 2}, 4)) == []


def test_a_near_tie_goes_either_way_and_a_gap_does_not():
    scores = torch.tensor([1.0, 0.50000001, 0.5, 0.1])
    assert topk_disagreements(scores, mask({0, 1}, 4), mask({0, 2}, 4)) == []
    apart = torch.tensor([1.0, 0.51, 0.5, 0.1])  # 2 % apart: decidable
    assert topk_disagreements(apart, mask({0, 1}, 4), mask({0, 2}, 4)) != []


def test_an_entry_clearly_above_or_below_the_cut_must_agree():
    (problem,) = topk_disagreements(SCORES, mask({0, 1}, 4), mask({1, 2}, 4), "row")  # count equal, 0 evicted
    assert problem.startswith("row: the reference evicts 1 entries clearly above the cut")
    problems = topk_disagreements(SCORES, mask({0, 1}, 4), mask({0, 3}, 4))
    assert any("clearly below" in p for p in problems)


def test_the_tied_entries_must_be_kept_as_many_times():
    assert topk_disagreements(SCORES, mask({0, 1}, 4), mask({0, 1, 2}, 4)) == [
        ": the reference keeps 3 entries, kvbench 2"]


def test_a_group_spanning_heads_counts_over_all_of_them():
    """KVzip's one cut over every layer and head: a tie may move an entry from one head to another."""
    scores = torch.tensor([[3.0, 2.0], [2.0, 1.0]])
    ours, theirs = torch.tensor([[True, True], [False, False]]), torch.tensor([[True, False], [True, False]])
    assert topk_disagreements(scores, ours, theirs) == []


def test_scores_that_did_not_make_kvbench_s_selection_fail():
    problems = topk_disagreements(torch.tensor([3.0, 0.0, 2.0, 1.0]), mask({0, 1}, 4), mask({0, 1}, 4))
    assert any("not the top-2" in p for p in problems)


def test_forced_entries_are_above_any_cut():
    scores = torch.tensor([float("inf"), 1.0, 2.0, 0.5])
    assert topk_disagreements(scores, mask({0, 2}, 4), mask({0, 2}, 4)) == []
    assert topk_disagreements(scores, mask({0, 2}, 4), mask({1, 2}, 4)) != []


def test_a_threshold_leaves_only_entries_at_it_undecided():
    scores = torch.tensor([-16.0, -17.000001, -18.0, float("inf")])
    ours = mask({0, 3}, 4)  # -17.000001 < -17: evicted by kvbench, kept by a reference rounding it up: a tie
    assert threshold_disagreements(scores, ours, mask({0, 1, 3}, 4), -17.0) == []
    (problem,) = threshold_disagreements(scores, ours, mask({0, 2, 3}, 4), -17.0, "head")
    assert problem.startswith("head: the reference decides 1 entries away from the threshold otherwise")
    assert threshold_disagreements(scores, mask({0}, 4), mask({0, 3}, 4), -17.0) != []  # the window is kept


def test_a_per_head_selection_differs_only_in_its_own_ties():
    """With a method's own scores (Knorm: -||k||): a tie swapped is fine, a clear entry is not; a method without
    scores of its own (StreamingLLM: positions) is compared exactly."""
    import kvbench.methods  # noqa: F401
    from kvbench.methods.base import LayerView
    from kvbench.registry import METHODS

    keys = torch.tensor([1.0, 2.0, 2.0, 3.0]).view(1, 1, 4, 1)  # scores -1, -2, -2, -3: top-2 is 0 and a tie
    view = LayerView(0, 1, keys, keys.clone(), None, 1.0)
    knorm = METHODS["knorm"]()
    assert row_disagreements(knorm, view, 0, {0, 1}, {0, 2}) == []
    assert row_disagreements(knorm, view, 0, {0, 1}, {1, 2}) != []
    assert row_disagreements(METHODS["streamingllm"](), view, 0, {0, 1}, {0, 2}) != []
