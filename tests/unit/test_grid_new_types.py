"""The grid launcher on two of issue 43's new types (a generic MoE decoder and a Mamba hybrid): one shared prefill per
sample and its configurations decoding together (batch_size=2) write exactly the records and scores of each
configuration's own batch-1 run through the basic launcher (timings and memory aside), as tests/unit/test_grid.py
checks on the hand-written families."""
from __future__ import annotations

import json

import pytest

from tests.unit.test_cli import grid_here, run_here
from tests.unit.test_grid import outputs

NIAH = ["dataset=niah", "dataset.context_lengths=[300]", "dataset.depth_percents=[0,50]", "dataset.max_new_tokens=4",
        "dataset.metrics=[pyramidkv_recall]", "report=false"]
CONFIGS = [["method=full"], ["method=snapkv", "method.window=8", "budget=32"]]


@pytest.mark.parametrize("model_type", ["qwen3_moe", "jamba"])
def test_grid_equals_batch_one_runs(model_type, tmp_path):
    model = ["model=hf", f"model.path=random:{model_type}", "model.name=tiny", "model.device=cpu"]
    for method in CONFIGS:
        run_here(*model, *method, *NIAH, "batch_size=1", results=tmp_path / "basic")
    grid_here([[*model, *method, *NIAH, "batch_size=2"] for method in CONFIGS], tmp_path / "grid")
    expected, got = outputs(tmp_path / "basic"), outputs(tmp_path / "grid")
    assert len(expected) == 2 and all(len(recs) == 2 and all("error" not in r for r in recs)
                                      for recs, _ in expected.values())
    assert any(r["kv_bytes"] < r["full_kv_bytes"] for recs, _ in expected.values() for r in recs)  # snapkv evicts
    assert got == expected
    shared = [r.get("prefill_shared_by") for path in (tmp_path / "grid").rglob("predictions.jsonl")
              for r in map(json.loads, path.read_text().splitlines())]
    assert shared == [2] * 4  # each sample prefilled once for both configurations, which then decoded together
