"""PyramidKV's per-layer budgets against the spec's hand-worked table (seed-pyramidkv.md §1.2)."""
from __future__ import annotations

import pytest

from kvbench.methods.pyramidkv import pyramid_budgets


@pytest.mark.parametrize("layers,budget,first,last,mean", [
    (32, 64, 110, 17, 71.5), (32, 96, 172, 17, 102.5), (32, 128, 234, 17, 133.5), (32, 256, 484, 19, 259.5),
    (32, 512, 983, 53, 526.0), (32, 1024, 1982, 60, 1029.0), (32, 2048, 3978, 103, 2048.5),
    (80, 64, 110, 31, 78.5), (80, 96, 172, 14, 101.0), (80, 128, 234, 76, 163.0), (80, 2048, 3978, 107, 2050.5),
])
def test_code_schedule_matches_spec_table(layers, budget, first, last, mean):
    kept = pyramid_budgets(100_000, layers, budget, window=8, beta=20)
    assert kept[0] - 8 == first and kept[-1] - 8 == last  # the table's k_l excludes the window
    assert sum(kept) / layers == mean


def test_regimes():
    assert pyramid_budgets(100, 32, 128, 8, 20) == [100] * 32  # n < B: no compression
    assert pyramid_budgets(200, 32, 128, 8, 20) == [128] * 32  # B <= n < 2(B - w): uniform SnapKV
    # clamp branch: 2c <= n with k_max >= n - w (B=128: n in [240, 242])
    kept = pyramid_budgets(241, 32, 128, 8, 20)
    assert kept[0] == 241 and max(kept) <= 241


@pytest.mark.parametrize("layers,budget", [(32, 64), (32, 128), (80, 128), (30, 128), (32, 2048)])
def test_exact_schedule_matches_the_budget(layers, budget):
    kept = pyramid_budgets(100_000, layers, budget, window=8, beta=20, exact=True)
    assert sum(kept) == layers * budget
    assert all(a >= b for a, b in zip(kept, kept[1:]))  # still a pyramid
