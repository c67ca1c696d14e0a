"""Comparing kept sets with a reference implementation's on what float rounding cannot change.

kvbench and the reference (kvpress, the authors' code) compute the same scores in a different order of float
operations, and two x86 CPUs round one order differently (AVX-512 vs AVX2 sums): an entry whose score lies within
rounding of the cut may be kept by one and evicted by the other (issue 42: `assert 43 == 44` on a KVzip+ head).
So a golden test compares, with kvbench's own scores of the same entries:
- every entry clearly above the cut must be kept by both, every entry clearly below it by neither;
- the entries near the cut (|score - cut| <= RTOL * |cut| + ATOL) are a tie: only how many of them a top-k keeps
  counts, over the whole group the top-k ran over (a head, a layer, every layer for KVzip's global cut).
kvbench's own kept set must itself be the top-k of the scores handed in, so a score that is not the one kvbench
selected with fails the comparison instead of widening it. tests/unit/test_decidable.py shows each rule failing.
"""
from __future__ import annotations

import torch
from torch import Tensor

RTOL = 1e-4  # fp32 scores after a 30-layer forward agree to ~1e-6 relative across CPUs; 100x that is a tie
ATOL = 1e-7  # for cuts at (or within rounding of) zero


def near(scores: Tensor, cut: float, rtol: float = RTOL, atol: float = ATOL) -> Tensor:
    """Which entries lie within rounding of the cut."""
    return (scores.double() - cut).abs() <= rtol * abs(cut) + atol


def topk_disagreements(scores: Tensor, ours: Tensor, theirs: Tensor, where: str = "",
                       rtol: float = RTOL) -> list[str]:
    """What differs between two top-k selections of one group on the decidable entries, and in count.

    `scores`: kvbench's scores of the group's entries (any shape; +inf for entries kept whatever they score);
    `ours`, `theirs`: boolean masks of the same shape, what kvbench and the reference keep. Returns one line per
    problem (empty: they agree on everything rounding cannot flip)."""
    scores, ours, theirs = scores.flatten().double(), ours.flatten(), theirs.flatten()
    k = int(ours.sum())
    if k == 0 or k == scores.numel():
        return [] if bool((ours == theirs).all()) else [f"{where}: kvbench keeps {k} of {scores.numel()}, "
                                                        f"the reference {int(theirs.sum())}"]
    ranked = scores.sort(descending=True).values
    low, high = ranked[k].item(), ranked[k - 1].item()  # the best evicted, the worst kept
    cut = (low + high) / 2 if high != float("inf") else low
    tie = near(scores, cut, rtol)  # exact ties at the cut among them (low == high: cut is their score)
    problems = []
    if bool((ours & (scores < cut) & ~tie).any()) or bool((~ours & (scores > cut) & ~tie).any()):
        problems.append(f"{where}: kvbench's own kept set is not the top-{k} of the scores handed in")
    above, below = (scores > cut) & ~tie, (scores < cut) & ~tie
    missing, extra = (above & ~theirs).nonzero().flatten(), (below & theirs).nonzero().flatten()
    if missing.numel():
        problems.append(f"{where}: the reference evicts {missing.numel()} entries clearly above the cut, e.g. "
                        f"{missing[:5].tolist()}")
    if extra.numel():
        problems.append(f"{where}: the reference keeps {extra.numel()} entries clearly below the cut, e.g. "
                        f"{extra[:5].tolist()}")
    if int(theirs.sum()) != k:
        problems.append(f"{where}: the reference keeps {int(theirs.sum())} entries, kvbench {k}")
    return problems


def threshold_disagreements(scores: Tensor, ours: Tensor, theirs: Tensor, threshold: float, where: str = "",
                            rtol: float = RTOL) -> list[str]:
    """What differs between two selections `score >= threshold` on the entries not within rounding of it (no count:
    a threshold keeps what passes). `scores` +inf for entries kept whatever they score (a window)."""
    scores, ours, theirs = scores.flatten().double(), ours.flatten(), theirs.flatten()
    tie = near(scores, threshold, rtol)
    problems = []
    if bool(((ours != (scores >= threshold)) & ~tie).any()):
        problems.append(f"{where}: kvbench's own kept set is not the entries scoring >= {threshold}")
    wrong = ((theirs != (scores >= threshold)) & ~tie).nonzero().flatten()
    if wrong.numel():
        problems.append(f"{where}: the reference decides {wrong.numel()} entries away from the threshold "
                        f"otherwise, e.g. {wrong[:5].tolist()}")
    return problems


def mask(positions: set[int] | list[int], n: int) -> Tensor:
    """A kept set as a boolean mask over n entries."""
    out = torch.zeros(n, dtype=torch.bool)
    out[list(positions)] = True
    return out


def row_disagreements(method, view, head: int, ours: set[int], theirs: set[int], where: str = "") -> list[str]:
    """A per-head selection `method.select(view, ...)` against a reference's kept set: equal, or differing only in
    ties of the method's own `scores(view)` (a prefix of the entries; those after it, a window, kept whatever they
    score). A method without such scores, or whose scores do not explain its own selection, is compared exactly."""
    if ours == theirs:
        return []
    n = view.prompt_len
    try:
        row = method.scores(view)[0, head].double()
    except (AttributeError, TypeError):  # no scores(view) of its own
        return [f"{where}: +{sorted(ours - theirs)[:5]} -{sorted(theirs - ours)[:5]}"]
    row = torch.cat([row, row.new_full((n - row.shape[0],), float("inf"))])
    return topk_disagreements(row, mask(ours, n), mask(theirs, n), where)
