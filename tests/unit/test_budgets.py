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


# --- Ada-Pyramid: FFY0/AdaKV `AdaptiveSnapKVCluster` (pyram_mode), no uniform regime ----------------------------
def official_ada_pyramid(q_len: int, n_layers: int, budget: int, window: int, beta: int, layer: int) -> int | None:
    """Transcribed by hand from the official per-layer code (seed-adakv.md §1.5): the selected budget of `layer`,
    or None when the layer is left uncompressed (its selected budget exceeds q_len - window)."""
    base = budget - window
    min_num = base // beta
    max_num = base * 2 - min_num
    if max_num >= q_len - window:
        max_num = q_len - window
        min_num = base * 2 - max_num
    steps = (max_num - min_num) // (n_layers - 1)
    selected = max_num - layer * steps
    return None if selected > q_len - window else selected


GRID = [(n, b, w, layers) for n in (100, 300, 700, 1100, 1500, 1900, 2100, 5000) for b in (128, 512, 1024)
        for w in (8, 32) for layers in (2, 24, 32)]


@pytest.mark.parametrize("n,budget,window,layers", GRID)
def test_ada_pyramid_budgets_equal_the_official_formula(n, budget, window, layers):
    from kvbench.methods.pyramidkv import ada_pyramid_budgets

    kept = ada_pyramid_budgets(n, layers, budget, window, beta=20)
    for layer, k in enumerate(kept):
        selected = official_ada_pyramid(n, layers, budget, window, 20, layer)
        if selected is None:
            assert k >= n  # generation.compress leaves the layer whole
        else:
            assert k == selected + window


def test_ada_pyramid_keeps_the_pyramid_where_pyramidkv_goes_uniform():
    from kvbench.methods.pyramidkv import ada_pyramid_budgets

    kept = ada_pyramid_budgets(1500, 32, 1024, 32, 20)  # the example: B <= n < 2(B - w)
    assert kept[0] == 1500 and kept[-1] == 570 and sum(kept) / 32 == 1035
    assert pyramid_budgets(1500, 32, 1024, 32, 20) == [1024] * 32  # PyramidKV's own regime switch stays


@pytest.mark.parametrize("alpha", [0.2, 0.5])
def test_ada_pyramid_cache_holds_the_official_layer_budgets(alpha):
    """Real cache on a tiny model, n between B and 2(B - w): each layer's heads hold the official layer budget
    (per-head split by Ada, total within rounding drift of +-H per layer)."""
    import kvbench.methods  # noqa: F401
    from kvbench.engine.batching import generate
    from kvbench.models import AttentionCapture
    from kvbench.registry import METHODS
    from tests.unit.tiny import prompt, tiny_model

    model = tiny_model("llama", layers=4)
    n, budget, window = 90, 64, 8  # B=64 <= n=90 < 2(B - w)=112
    method = METHODS["ada_pyramidkv"](window=window, alpha=alpha)
    with AttentionCapture(model, window=window) as capture:
        gen = generate(model, None, method, capture, prompt(n), budget, 1, eos_ids=set())
    for layer, per_head in enumerate(gen.kept_per_head):
        selected = official_ada_pyramid(n, 4, budget, window, 20, layer)
        expected = n if selected is None else selected + window
        assert abs(sum(per_head) - len(per_head) * expected) <= len(per_head), (layer, per_head)


def test_pyramidkv_adakv_schedule_is_the_official_ada_schedule():
    """Ada-KV's "Pyramid" rows come from its own code (SnapKVCluster, pyram_mode): the same clamp, no regime switch."""
    import kvbench.methods  # noqa: F401
    from kvbench.registry import METHODS

    method = METHODS["pyramidkv"](window=32, schedule="adakv")
    for n in (300, 1100, 1500, 5000):
        expected = [(official_ada_pyramid(n, 32, 1024, 32, 20, layer) or n) + (32 if official_ada_pyramid(
            n, 32, 1024, 32, 20, layer) is not None else 0) for layer in range(32)]
        got = method.layer_budgets(n, 32, 1024)
        assert [min(g, n) for g in got] == [min(e, n) for e in expected]
