"""kvbench.metrics.stats against hand computations, a coverage simulation and the delta method."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest

from kvbench.metrics.stats import (bootstrap_se, exp_of_mean, exp_of_ratio, geometric_mean_of_means, mean_se,
                                   metric_stats, pair_by_id, paired_bootstrap, stratified_mean_se)
from kvbench.runs.store import aggregate


def test_mean_se_by_hand():
    # mean 0.7; squared deviations .09 .49 .09 .09 .04 sum to 0.8; sd = sqrt(0.8 / 4); se = sd / sqrt(5) = 0.2
    est = mean_se([1.0, 0.0, 1.0, 1.0, 0.5])
    assert est.mean == pytest.approx(0.7) and est.se == pytest.approx(0.2) and est.n == 5
    assert mean_se([1.0]).se is None and mean_se([]).n == 0
    assert mean_se([1.0, float("nan"), 0.0]).n == 2          # a failed sample is left out, not scored 0


def test_average_of_task_means_se_by_hand():
    # task a: [1, 0] -> mean .5, sd^2 = .5, var of mean .25; task b: [1, 1, 0, 0] -> sd^2 = 1/3, var of mean 1/12.
    # Avg. = (.5 + .5) / 2; var = (.25 + 1/12) / 4 = 1/12. Averaging the two se's (.5, .2887) would give .394.
    est = stratified_mean_se([1, 0, 1, 1, 0, 0], ["a", "a", "b", "b", "b", "b"])
    assert est.mean == pytest.approx(0.5) and est.se == pytest.approx(math.sqrt(1 / 12)) and est.n == 6


def _rec(i: int, m: float, r: float) -> dict:
    return {"id": f"s{i}", "score": m, "scores": {"m": m, "rouge": r}, "kv_bytes": 10, "full_kv_bytes": 40,
            "effective_budget": 4.0, "prefill_s": 1.0, "decode_tok_s": 2.0}


def test_scores_json_stats_block_by_hand():
    records = [_rec(i, m, 0.5) for i, m in enumerate([1.0, 0.0, 1.0, 1.0, 0.5])]
    summary = aggregate(records)
    assert summary["metrics"] == {"m": pytest.approx(0.7), "rouge": pytest.approx(0.5)}   # readers' dict unchanged
    assert summary["stats"]["m"] == {"mean": pytest.approx(0.7), "se": pytest.approx(0.2), "n": 5,
                                     "se_method": "sd/sqrt(n)"}
    assert summary["stats"]["rouge"]["se"] == 0.0


def test_bootstrap_is_reproducible_with_its_seed():
    d = np.random.default_rng(1).normal(0.1, 1.0, 50)
    a, b = paired_bootstrap(d, resamples=500, seed=7), paired_bootstrap(d, resamples=500, seed=7)
    assert a == b and (a.resamples, a.seed, a.n) == (500, 7, 50)
    assert paired_bootstrap(d, resamples=500, seed=8) != a
    assert a.diff == pytest.approx(d.mean()) and a.lo < a.diff < a.hi


def test_paired_interval_covers_the_true_difference():
    """200 simulated paired runs of 200 binary samples; the reference is right 70 % of the time and the method
    loses 15 % of those and fixes 10 % of the rest: true difference -0.075. A 95 % interval must cover it in at
    least 93 % of the runs, and must not be so wide that it nearly always does (<= 99 %)."""
    rng = np.random.default_rng(2026)
    truth, covered, excluded_zero = -0.7 * 0.15 + 0.3 * 0.10, 0, 0
    for k in range(200):
        ref = rng.random(200) < 0.7
        flip = rng.random(200) < np.where(ref, 0.15, 0.10)
        method = ref ^ flip
        ci = paired_bootstrap(method.astype(float) - ref.astype(float), resamples=1000, seed=k)
        covered += ci.lo <= truth <= ci.hi
        excluded_zero += ci.excludes_zero
    assert 186 <= covered <= 198
    assert excluded_zero > 100            # a 7.5-point loss on 200 paired samples is usually detected


def test_stratified_paired_bootstrap_is_the_average_of_task_differences():
    diffs = [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]            # task a: all +1 (2 samples); task b: 0 (6 samples)
    ci = paired_bootstrap(diffs, strata=["a", "a", "b", "b", "b", "b", "b", "b"], resamples=300)
    assert ci.diff == pytest.approx(0.5)                       # (1 + 0) / 2, not the pooled mean 2/8
    assert ci.lo == pytest.approx(0.5) and ci.hi == pytest.approx(0.5)   # no within-task variation: no spread


def test_pairing_by_id_survives_shuffled_ids():
    ids = [f"niah-{n}-{d}" for n in (1000, 2000, 3000) for d in (0, 25, 50, 75, 100)]
    rng = random.Random(0)
    ref = {i: float(rng.random() < 0.8) for i in ids}
    method = {i: float(rng.random() < 0.5) for i in ids[:-2]} | {"extra-1": 1.0}   # two missing, one extra
    shuffled = dict(rng.sample(list(method.items()), len(method)))
    p, q = pair_by_id(method, ref), pair_by_id(shuffled, dict(reversed(list(ref.items()))))
    assert p.ids == q.ids and len(p.ids) == len(ids) - 2
    assert list(q.a - q.b) == [method[i] - ref[i] for i in q.ids]
    assert q.only_a == ["extra-1"] and q.only_b == sorted(ids[-2:])
    assert paired_bootstrap(q.a - q.b, resamples=200) == paired_bootstrap(p.a - p.b, resamples=200)


def test_corpus_metric_bootstrap_agrees_with_the_delta_method():
    rng = np.random.default_rng(3)
    nll = rng.normal(2.0, 0.5, 400)
    ppl = exp_of_mean("nll")
    table = nll[:, None]
    delta_se = math.exp(nll.mean()) * nll.std(ddof=1) / math.sqrt(len(nll))   # d/dm exp(m) = exp(m)
    assert ppl.value(table) == pytest.approx(math.exp(nll.mean()))
    assert bootstrap_se(table, ppl.statistic, resamples=2000, seed=0) == pytest.approx(delta_se, rel=0.08)


def test_geometric_mean_rouge_in_scores_stats():
    records = [_rec(i, 0.1 * (i % 3 + 1), 0.2 + 0.05 * (i % 4)) for i in range(12)]
    stats = metric_stats(records, {"mean_rouge": geometric_mean_of_means("m", "rouge")}, resamples=400, seed=5)
    m, r = np.mean([x["scores"]["m"] for x in records]), np.mean([x["scores"]["rouge"] for x in records])
    assert stats["mean_rouge"]["mean"] == pytest.approx(math.sqrt(m * r))
    assert stats["mean_rouge"]["resamples"] == 400 and stats["mean_rouge"]["seed"] == 5
    assert 0 < stats["mean_rouge"]["se"] < 0.05
    again = metric_stats(records, {"mean_rouge": geometric_mean_of_means("m", "rouge")}, resamples=400, seed=5)
    assert again == stats


def test_token_weighted_perplexity_from_record_fields():
    """exp(sum NLL / sum tokens) over records carrying nll_sum and n_tokens at the top level (no `scores`)."""
    records = [{"id": "w0", "nll_sum": 20.0, "n_tokens": 10}, {"id": "w1", "nll_sum": 90.0, "n_tokens": 30},
               {"id": "w2", "nll_sum": 33.0, "n_tokens": 11}]
    stats = metric_stats(records, {"ppl": exp_of_ratio("nll_sum", "n_tokens")}, resamples=300)
    assert stats["ppl"]["mean"] == pytest.approx(math.exp(143 / 51)) and stats["ppl"]["n"] == 3
    assert stats["ppl"]["se"] > 0 and stats["ppl"]["se_method"] == "bootstrap"
    zero = metric_stats([_rec(0, 0.0, 0.3), _rec(1, 0.0, 0.5)], {"g": geometric_mean_of_means("m", "rouge")})
    assert zero["g"]["mean"] == 0.0 and zero["g"]["se"] == 0.0       # a zero mean gives 0, as BUZZ's mean_rouge


def test_seed_datasets_corpus_metrics_agree_with_their_own_summaries():
    """The bootstrap-backed corpus metrics that summarization and wikitext_ppl declare give the same value as the
    numbers their summarize() reports (BUZZ's mean ROUGE x100; token-weighted PPL)."""
    from pathlib import Path

    from kvbench.data.base import Sample
    from kvbench.data.summarization import CnnDailymail
    from kvbench.data.wikitext import WikitextPPL

    fixtures = Path(__file__).resolve().parents[1] / "fixtures"
    ds = CnnDailymail(root=str(fixtures / "cnn_dailymail"))
    s = Sample("a", "p", ["The cat sat on the mat ."], 10)
    records = [{"id": str(i), "scores": ds.score(s, p)}
               for i, p in enumerate(("The cat sat on the mat.", "A dog sat.", "The mat was red."))]
    stats = metric_stats(records, ds.corpus_metrics, resamples=200)
    assert 100 * stats["buzz_mean_rouge"]["mean"] == pytest.approx(
        ds.summarize(records)["summarization"]["buzz_rouge"]["mean_rouge"])
    ppl = WikitextPPL(root=str(fixtures / "wikitext_ppl"), mode="chunked", window=32, context=20)
    windows = [{"id": "w0", "nll_sum": 2.0, "n_tokens": 4}, {"id": "w1", "nll_sum": 4.0, "n_tokens": 2}]
    assert metric_stats(windows, ppl.corpus_metrics, resamples=200)["ppl"]["mean"] == pytest.approx(
        ppl.summarize(windows)["perplexity"]["ppl"])
