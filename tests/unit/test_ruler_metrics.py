"""RULER scoring on hand-worked cases: postprocessing, string_match_all / _part, upstream's batched rounding, and
the per-task / per-length summary."""
from __future__ import annotations

import pytest

from kvbench.data.base import Sample
from kvbench.data.ruler import Ruler
from kvbench.metrics.ruler import postprocess, string_match_all, string_match_part, task_score
from kvbench.registry import METRICS


def test_registered_under_upstream_names():
    assert METRICS["string_match_all"] is string_match_all and METRICS["string_match_part"] is string_match_part


def test_postprocess_replaces_control_characters_with_newlines():
    assert postprocess("  \x01answer:\t1234\x1f 5678\n ") == "answer:\n1234\n 5678"
    assert postprocess("\n\t ") == ""


@pytest.mark.parametrize("pred,refs,all_,part", [
    ("The numbers are 1234567 and 7654321.", ["1234567", "7654321"], 1.0, 1.0),
    ("The numbers are 1234567.", ["1234567", "7654321", "1111111", "2222222"], 0.25, 1.0),
    ("nothing here", ["1234567"], 0.0, 0.0),
    ("PARIS is the answer", ["paris", "France"], 0.5, 1.0),      # case-insensitive, per reference
    ("12345678", ["1234567"], 1.0, 1.0),                           # substring, not token match
    ("", ["a"], 0.0, 0.0),
])
def test_per_sample_values(pred, refs, all_, part):
    assert string_match_all(pred, refs) == all_ and string_match_part(pred, refs) == part


def test_task_score_rounds_like_upstream():
    # upstream: round(sum(values) / len(preds) * 100, 2)
    preds = ["a b", "a", "", "b"]
    refs = [["a", "b"], ["a", "b", "c"], ["a"], ["x", "b"]]
    assert task_score("string_match_all", preds, refs) == round((1 + 1 / 3 + 0 + 0.5) / 4 * 100, 2) == 45.83
    assert task_score("string_match_part", preds, refs) == 75.0
    with pytest.raises(ValueError):
        task_score("string_match_all", [], [])


def rec(task: str, length: int, prediction: str, references: list[str]) -> dict:
    return {"meta": {"task": task, "length": length}, "prediction": prediction, "references": references}


def test_score_uses_each_tasks_metric():
    ds = Ruler()
    qa = Sample("qa_1-4096-0", "p", ["Paris", "paris, France"], 32, meta={"task": "qa_1"})
    mv = Sample("niah_multivalue-4096-0", "p", ["1", "2", "3", "4"], 128, meta={"task": "niah_multivalue"})
    assert ds.score(qa, " \x02Paris\n") == {"string_match": 1.0}
    assert ds.score(mv, "1, 2 and 9") == {"string_match": 0.5}


def test_summarize_per_task_per_length_and_average():
    ds = Ruler(tasks=["niah_single_1", "vt", "qa_2"], lengths=[4096, 8192])
    records = [
        rec("niah_single_1", 4096, "1234567", ["1234567"]), rec("niah_single_1", 4096, "", ["7654321"]),
        rec("vt", 4096, "AAAAA BBBBB", ["AAAAA", "BBBBB", "CCCCC"]), rec("vt", 4096, "CCCCC", ["AAAAA", "CCCCC"]),
        rec("qa_2", 4096, "Ivo Marek", ["Ivo Marek"]), rec("qa_2", 4096, "none", ["Ada"]),
        rec("niah_single_1", 8192, "1", ["1"]),
    ]
    out = ds.summarize(records)["ruler"]
    assert out["code"] == "NVIDIA/RULER@c5341b4" and out["version"] == "2024-12.1" and out["skipped"] == {}
    at4k = out["lengths"]["4096"]
    # per-sample scores 1 and 0: sd = sqrt(1/2), se = sd / sqrt(2) = 0.5, x100
    assert at4k["tasks"]["niah_single_1"] == {"score": 50.0, "nulls": "1/2", "n": 2, "metric": "string_match_all",
                                              "se": 50.0}
    assert at4k["tasks"]["vt"]["score"] == round((2 / 3 + 1 / 2) / 2 * 100, 2) == 58.33
    assert at4k["tasks"]["qa_2"]["metric"] == "string_match_part" and at4k["tasks"]["qa_2"]["score"] == 50.0
    assert list(at4k["tasks"]) == ["niah_single_1", "vt", "qa_2"]           # RULER's task order
    assert at4k["average"] == round((50 + 58.33 + 50) / 3, 2) and at4k["n_tasks"] == 3
    assert out["lengths"]["8192"]["average"] == 100.0
    assert out["average"] == round((at4k["average"] + 100.0) / 2, 2)
    # vt: 2/3 and 1/2 -> se = |2/3 - 1/2| / 2 = 1/12; qa_2: 1 and 0 -> 0.5; the average's se = sqrt(sum se^2) / 3
    assert at4k["tasks"]["vt"]["se"] == round(100 / 12, 4)
    assert at4k["average_se"] == round(100 * (0.25 + 1 / 144 + 0.25) ** 0.5 / 3, 4)
    assert out["lengths"]["8192"]["average_se"] is None and out["average_se"] is None   # one sample: no se
