"""Standard errors in the seed-task tables (summarization, 10-doc QA, perplexity, InfiniteBench)."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from kvbench.metrics.stats import paired_bootstrap, paired_statistic_bootstrap
from kvbench.report import seed_tasks
from kvbench.report.compare import Compare


def frame(rows: list[dict], dataset: str) -> pd.DataFrame:
    base = {"model": "m", "method": "snapkv", "budget": 64, "ratio": None, "dataset": dataset, "kv_bytes": 10,
            "full_kv_bytes": 100}
    return pd.DataFrame([{**base, "id": f"s{i}", **r} for i, r in enumerate(rows)])


def test_summarization_se_and_bootstrap_se_of_the_geometric_mean(tmp_path):
    rng = np.random.default_rng(0)
    r = rng.uniform(0.1, 0.6, size=(60, 3))
    rows = [{"meta.protocol": "buzz", **{f"scores.{k}": v for k, v in zip(("rouge1", "rouge2", "rougeL"), x)},
             "scores.rougeLsum": x[2], **{f"scores.buzz_{k}": v for k, v in zip(("rouge1", "rouge2", "rougeL"), x)}}
            for x in r]
    table = seed_tasks.summarization_table(frame(rows, "xsum"))
    row = table.iloc[0]
    assert row["se:KF rouge1"] == pytest.approx(100 * r[:, 0].std(ddof=1) / math.sqrt(60))
    # delta method for the geometric mean G of three means: var(G)/G^2 ~ var(sum_k log m_k / 3)
    means = r.mean(axis=0)
    grad = np.exp(np.log(means).mean()) / (3 * means)
    delta = math.sqrt(grad @ np.cov(r.T) @ grad / 60)
    assert row["se:BUZZ Mean"] == pytest.approx(100 * delta, rel=0.1)
    md = seed_tasks.write_reports(frame(rows, "xsum"), tmp_path, stderr=True)[0].read_text()
    assert f"{row['BUZZ Mean']:.2f} ± {row['se:BUZZ Mean']:.2f}" in md and "se:" not in md
    csv = pd.read_csv(tmp_path / "xsum_table.csv")
    assert list(csv.columns)[-1].startswith("se:") and "se:BUZZ Mean" in csv


def test_qa_and_task_averages_get_the_se_of_a_mean_of_group_means():
    hits = {0: [1, 0], 4: [1, 1, 0, 0]}          # var of group means: .25 and 1/12; Avg.'s se = sqrt(1/3) / 2
    rows = [{"meta.gold_position": p, "scores.best_subspan_em": float(h)} for p, hs in hits.items() for h in hs]
    row = seed_tasks.qa_table(frame(rows, "lost_in_the_middle")).iloc[0]
    assert row["se:gold@0"] == pytest.approx(50.0) and row["se:Avg."] == pytest.approx(100 * math.sqrt(1 / 3) / 2)
    rows = [{"meta.task": t, "score": float(h)} for t, hs in (("kv_retrieval", [1, 0]), ("passkey", [1, 1, 0, 0]))
            for h in hs]
    row = seed_tasks.task_table(frame(rows, "infinitebench")).iloc[0]
    assert row["se:Avg."] == pytest.approx(100 * math.sqrt(1 / 3) / 2) and row["Avg."] == pytest.approx(50.0)


def test_perplexity_bootstrap_se_agrees_with_the_delta_method():
    rng = np.random.default_rng(1)
    tokens = rng.integers(200, 600, 150)
    nll = tokens * rng.normal(2.5, 0.3, 150)
    rows = [{"meta.task": "chunked", "nll_sum": a, "n_tokens": int(b)} for a, b in zip(nll, tokens)]
    row = seed_tasks.perplexity_table(frame(rows, "wikitext_ppl")).iloc[0]
    ratio = nll.sum() / tokens.sum()                     # ratio estimator: se = sd(nll - R n) / (sqrt(n) mean(n))
    se_ratio = (nll - ratio * tokens).std(ddof=1) / (math.sqrt(len(nll)) * tokens.mean())
    assert row["PPL"] == pytest.approx(math.exp(ratio))
    assert row["se:PPL"] == pytest.approx(math.exp(ratio) * se_ratio, rel=0.1)


def test_paired_statistic_bootstrap_reduces_to_the_paired_mean_difference():
    rng = np.random.default_rng(4)
    a, b = rng.random(40), rng.random(40)
    general = paired_statistic_bootstrap(a[:, None], b[:, None], lambda x: x[..., 0].mean(axis=-1), 500, 3)
    plain = paired_bootstrap(a - b, resamples=500, seed=3)                 # the same resampled ids, same seed
    assert (general.diff, general.lo, general.hi) == pytest.approx((plain.diff, plain.lo, plain.hi))


def test_compare_marks_seed_table_cells(tmp_path):
    rng = np.random.default_rng(5)
    tokens = rng.integers(200, 400, 40)
    base = tokens * rng.normal(2.0, 0.2, 40)
    full = [{"meta.task": "stream", "nll_sum": x, "n_tokens": int(n)} for x, n in zip(base, tokens)]
    worse = [{"meta.task": "stream", "nll_sum": x + 0.3 * n, "n_tokens": int(n)} for x, n in zip(base, tokens)]
    df = pd.concat([frame(full, "wikitext_ppl").assign(method="full", budget=None),
                    frame(worse[:-1], "wikitext_ppl")])                  # one window the method never ran
    seed_tasks.write_reports(df, tmp_path, stderr=True, compare=Compare("full", resamples=300))
    md = (tmp_path / "wikitext_ppl_table.md").read_text()
    row = pd.read_csv(tmp_path / "wikitext_ppl_table.csv").query("method == 'snapkv'").iloc[0]
    ratio = lambda nll, n: math.exp(sum(nll) / sum(n))  # noqa: E731
    truth = ratio([w["nll_sum"] for w in worse[:-1]], tokens[:-1]) - ratio(base[:-1], tokens[:-1])
    assert row["diff:PPL"] == pytest.approx(truth) and row["lo:PPL"] > 0
    snap = next(line for line in md.splitlines() if "| SnapKV |" in line)
    assert f"{row['PPL']:.3f} ± {row['se:PPL']:.3f}†" in snap and "300 resamples" in md
    assert "SnapKV 64: 0 ids only in this run, 1 only in FullKV's" in md


def test_compare_covers_every_summarization_column(tmp_path):
    rng = np.random.default_rng(6)
    r = rng.uniform(0.3, 0.6, size=(30, 3))
    def rows(x):
        return [{"meta.protocol": "buzz", "scores.rougeLsum": v[2],
                 **{f"scores.{k}": y for k, y in zip(("rouge1", "rouge2", "rougeL"), v)},
                 **{f"scores.buzz_{k}": y for k, y in zip(("rouge1", "rouge2", "rougeL"), v)}} for v in x]
    df = pd.concat([frame(rows(r), "xsum").assign(method="full", budget=None), frame(rows(r * 0.8), "xsum")])
    table = seed_tasks.add_differences(seed_tasks.summarization_table(df), df, "xsum", Compare("full", 200))
    snap = table[table["method"] == "snapkv"].iloc[0]
    geo = lambda x: np.exp(np.log(x.mean(axis=0)).mean())  # noqa: E731
    assert snap["diff:BUZZ Mean"] == pytest.approx(100 * (geo(r * 0.8) - geo(r)))
    assert snap["diff:KF rouge1"] == pytest.approx(100 * (0.8 - 1) * r[:, 0].mean())
    marked = {c for (i, c) in table.attrs["marks"]}
    assert marked == {"KF rouge1", "KF rouge2", "KF rougeL", "KF rougeLsum", "BUZZ R-1", "BUZZ R-2", "BUZZ R-L",
                      "BUZZ Mean"}
