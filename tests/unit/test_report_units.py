"""What the report says about runs whose samples are not one per prompt: a reasoning set's `dataset.samples=k`
(k generations of each problem, the problem is the unit of pass@1 and its se) and ratio runs (no run-wide budget).
Run directories are written as kvbench.run writes them and read by the report's own loader."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from kvbench.data.reasoning import pass_at_1
from kvbench.metrics.stats import mean_se, paired_bootstrap, unit_mean_se
from kvbench.report import load_runs, summary_table
from kvbench.report.compare import Compare
from kvbench.report.lengths import length_table, to_markdown as lengths_markdown
from kvbench.report.seed_tasks import task_table

# 3 problems x 2 samples each, chosen so that the se over problems differs from the se over the 6 samples
FULL = {"000": [1.0, 1.0], "001": [1.0, 0.0], "002": [0.0, 0.0]}
SNAP = {"000": [1.0, 1.0], "001": [0.0, 0.0], "002": [0.0, 0.0]}


def write_run(root: Path, dataset: str, method: str, records: list[dict], budget: int | None = None,
              ratio: float | None = None, primary: str = "math_verify") -> Path:
    run = root / dataset / "m" / method / (f"r{ratio}" if ratio is not None else f"b{budget}")
    run.mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"model": "m", "dataset": dataset, "method": method,
                                                   "budget": budget, "ratio": ratio, "primary_metric": primary}))
    (run / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def reasoning_records(per_problem: dict[str, list[float]]) -> list[dict]:
    """Records as kvbench.data.reasoning builds them: ids `<problem>#<k>`, meta.problem, the samples in a row."""
    return [{"id": f"aime25-{p}#{k}", "prediction": "", "references": ["1"], "score": v,
             "scores": {"math_verify": v}, "meta": {"problem": f"aime25-{p}", "sample": k}, "new_tokens": 10 + k}
            for p, values in per_problem.items() for k, v in enumerate(values)]


@pytest.fixture(scope="module")
def sampled(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("results")
    write_run(root, "aime25", "full", reasoning_records(FULL))
    write_run(root, "aime25", "snapkv", reasoning_records(SNAP), budget=64)
    return root


def test_unit_mean_se_by_hand():
    values, units = [1, 1, 1, 0, 0, 0], ["a", "a", "b", "b", "c", "c"]
    est = unit_mean_se(values, units)  # problem means 1, 0.5, 0: sd 0.5 over 3 problems
    assert (est.mean, est.n) == (0.5, 3) and est.se == pytest.approx(0.5 / math.sqrt(3))
    assert mean_se(values).se == pytest.approx(math.sqrt(0.3) / math.sqrt(6))  # the 6 samples as if independent
    assert unit_mean_se([1, float("nan"), 0], ["a", "b", "c"]).n == 2  # a failed sample's problem drops out
    assert unit_mean_se([0.2, 0.9], ["x", "y"]) == mean_se([0.2, 0.9])  # one sample per unit: the plain se


def test_report_se_is_over_problems_as_pass_at_1(sampled):
    table = summary_table(load_runs([sampled])).set_index("method")
    for method, per_problem in (("full", FULL), ("snapkv", SNAP)):
        means = [np.mean(v) for v in per_problem.values()]
        se = 100 * np.std(means, ddof=1) / math.sqrt(3)
        assert table.loc[method, "math_verify"] == pytest.approx(100 * np.mean(means))
        assert table.loc[method, "se"] == pytest.approx(se) and table.loc[method, "n"] == 6
        own = pass_at_1(reasoning_records(per_problem), ("math_verify",))["math_verify"]  # the dataset's summary
        assert table.loc[method, "se"] == pytest.approx(100 * own["se"])
        samples = [v for vs in per_problem.values() for v in vs]
        assert table.loc[method, "se"] != pytest.approx(100 * mean_se(samples).se)
    lengths = length_table(load_runs([sampled])).set_index("method")
    assert lengths.loc["full", "score_se"] == pytest.approx(table.loc["full", "se"])
    assert lengths.loc["full", "length_se"] == 0.0  # lengths 10 and 11 in every problem: the problem means agree


def test_paired_bootstrap_averages_each_problems_differences_and_resamples_problems(sampled):
    compare = Compare("full", resamples=500)
    row = summary_table(load_runs([sampled]), compare).set_index("method").loc["snapkv"]
    by_problem = [np.mean(np.subtract(SNAP[p], FULL[p])) for p in FULL]  # 0, -0.5, 0
    hand = paired_bootstrap(by_problem, resamples=500).scaled(100)
    assert (row["diff"], row["diff_lo"], row["diff_hi"], row["n_paired"]) == \
        pytest.approx((hand.diff, hand.lo, hand.hi, 3))
    assert row["diff_se"] == pytest.approx(hand.se)
    per_sample = [s - f for p in FULL for s, f in zip(SNAP[p], FULL[p])]
    assert row["diff_se"] != pytest.approx(paired_bootstrap(per_sample, resamples=500).scaled(100).se)
    assert "a problem's samples averaged" in compare.note()[0]


def test_ratio_runs_are_told_apart_by_their_ratio(tmp_path):
    """Ratio runs record no budget (kvbench.runs.records.recorded_budget); two ratios of one method stay two rows."""
    for ratio, score in ((0.5, 1.0), (0.75, 0.0)):
        write_run(tmp_path, "aime25", "snapkv", [{**r, "score": score} for r in reasoning_records({"0": [1.0]})],
                  ratio=ratio)
        write_run(tmp_path, "infinitebench", "snapkv", [{"id": "t-0", "score": score, "scores": {"f1": score},
                                                         "meta": {"task": "kv_retrieval"}}], ratio=ratio, primary="f1")
    df = load_runs([tmp_path])
    lengths = length_table(df[df["dataset"] == "aime25"])
    assert sorted(zip(lengths["ratio"], lengths["score"])) == [(0.5, 100.0), (0.75, 0.0)]
    assert "| SnapKV | r0.5 |" in lengths_markdown(lengths)
    seed = task_table(df[df["dataset"] == "infinitebench"])
    assert sorted(zip(seed["ratio"], seed["Avg."])) == [(0.5, 100.0), (0.75, 0.0)]
