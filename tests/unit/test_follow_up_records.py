"""Records of a sample asked twice (LongBench v2's CoT, kvbench.runs.follow_up): the record schema types their
`response_cot` and `follow_up` (and the second request's own fields inside it), and the totals and means over
samples (the report's frame and tables, scores.json) count both requests' work. Before, a `follow_up` that was not an
object passed as valid, and the second request's prefill, decode, tokens and KV bytes were left out of every sum."""
from __future__ import annotations

import json

import pytest

from kvbench.report.records import record_problem, with_follow_up_work
from kvbench.report.runs import load_runs
from kvbench.report.tables import summary_table
from kvbench.runs.store import aggregate


def request(prefill_s: float, decode_s: float, new_tokens: int, kv_bytes: int, full_kv_bytes: int,
            peak_kv_bytes: int, kv_bytes_mean: float) -> dict:
    """One request's accounting fields, its decode steps = new_tokens (decode_tok_s = new_tokens / decode_s)."""
    return {"prefill_s": prefill_s, "compress_s": 0.5, "decode_s": decode_s, "decode_tok_s": new_tokens / decode_s,
            "e2e_s": prefill_s + 0.5 + decode_s, "new_tokens": new_tokens, "kv_bytes": kv_bytes,
            "full_kv_bytes": full_kv_bytes, "peak_kv_bytes": peak_kv_bytes, "kv_bytes_peak": peak_kv_bytes,
            "kv_bytes_mean": kv_bytes_mean, "peak_mem_bytes": 1000}


def sample(i: int, score: float, second: dict | None) -> dict:
    first = request(2.0, 4.0, 40, 100, 400, 150, 120.0)
    rec = {"id": f"q{i}", "prediction": "B", "references": ["B"], "score": score, "scores": {"accuracy": score},
           "meta": {}, "prompt_tokens": 400, "budget": 100, "effective_budget": 100.0, **first}
    if second is not None:
        rec.update(response_cot="The reports agree on B.", follow_up={"prompt_tokens": 440, "budget": 110, **second})
    return rec


SECOND = request(3.0, 1.0, 2, 110, 440, 200, 180.0)
# both samples, worked by hand: q0 asked twice (first + SECOND), q1 once (first only)
Q0 = {"prefill_s": 5.0, "compress_s": 1.0, "decode_s": 5.0, "e2e_s": 11.0, "new_tokens": 42, "kv_bytes": 210,
      "full_kv_bytes": 840, "peak_kv_bytes": 200, "kv_bytes_peak": 200, "decode_tok_s": 42 / 5.0,
      "kv_bytes_mean": (120.0 * 40 + 180.0 * 2) / 42}


def test_the_follow_up_fields_are_typed():
    good = sample(0, 1.0, SECOND)
    assert record_problem(good) is None and record_problem(sample(1, 0.0, None)) is None
    assert record_problem({**good, "response_cot": 3}) == "'response_cot' is 3, not a string"
    assert record_problem({**good, "follow_up": "x"}) == "'follow_up' is \"x\", not an object"
    assert record_problem({**good, "follow_up": {**SECOND, "decode_s": "1"}}) == \
        "'follow_up.decode_s' is \"1\", not a number"


def test_a_record_asked_twice_counts_both_requests_work():
    folded = with_follow_up_work(sample(0, 1.0, SECOND))
    assert {k: folded[k] for k in Q0} == pytest.approx(Q0)
    assert folded["follow_up"] == {"prompt_tokens": 440, "budget": 110, **SECOND}  # the second's own, as written
    once = sample(1, 0.0, None)
    assert with_follow_up_work(once) is once


def test_report_and_scores_totals_over_two_records(tmp_path):
    records = [sample(0, 1.0, SECOND), sample(1, 0.0, None)]
    run = tmp_path / "longbench_v2" / "m" / "snapkv" / "b100-abcd1234"
    run.mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"method": "snapkv", "budget": 100, "ratio": None, "model": "m",
                                                   "dataset": "longbench_v2", "primary_metric": "accuracy"}))
    (run / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    df = load_runs([tmp_path]).set_index("id")
    assert df.loc["q0", "e2e_s"] == 11.0 and df.loc["q1", "e2e_s"] == 6.5 and df.loc["q0", "new_tokens"] == 42
    row = summary_table(df.reset_index()).iloc[0]
    assert row["kv_bytes_frac"] == pytest.approx((210 + 100) / (840 + 400))  # both prompts' caches, over both
    assert row["prefill_s"] == pytest.approx((5.0 + 2.0) / 2)
    assert row["decode_tok_s"] == pytest.approx((42 / 5.0 + 40 / 4.0) / 2)
    scores = aggregate(records)
    assert scores["prefill_s_mean"] == pytest.approx(3.5) and scores["kv_bytes_mean"] == pytest.approx(155)
    assert scores["kv_ratio"] == pytest.approx(155 / 620)
