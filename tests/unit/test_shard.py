"""`shard=i/n`: parsing, the deterministic split by sample id, and the cost meter's arithmetic."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from kvbench.runs.cost import CostMeter, totals
from kvbench.runs.shard import Shard, assign


def test_parse_accepts_i_of_n_and_rejects_the_rest_in_one_line():
    assert Shard.parse(None) is None and Shard.parse("") is None
    assert Shard.parse("2/4") == Shard(2, 4) and Shard.parse(" 0 / 1 ") == Shard(0, 1)
    assert Shard(1, 4).predictions_name == "predictions.shard-1-of-4.jsonl"
    assert Shard(1, 4).manifest_name == "manifest.shard-1-of-4.json"
    for bad in ("4/4", "1/0", "-1/3", "1", "a/b", "1/2/3"):
        with pytest.raises(ValueError) as e:
            Shard.parse(bad)
        assert "\n" not in str(e.value) and "i/n" in str(e.value)


def test_split_follows_the_sha256_order_of_the_ids():
    # sha256 prefixes: d=18ac3e73, c=2e7d2c03, b=3e23e816, e=3f79bb7b, a=ca978112 -> dealt round-robin
    assert assign(["a", "b", "c", "d", "e"], 2) == [["d", "b", "a"], ["c", "e"]]
    assert assign(["a", "b", "c", "d", "e"], 1) == [["d", "c", "b", "e", "a"]]


def test_split_is_a_balanced_partition_independent_of_input_order():
    ids = [f"niah-L{n}-d{d}" for n in (1000, 2000, 4000) for d in range(0, 101, 10)]
    parts = assign(ids, 4)
    assert sorted(i for p in parts for i in p) == sorted(ids)  # every id exactly once
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    shuffled = ids[:]
    random.Random(0).shuffle(shuffled)
    assert assign(shuffled, 4) == parts  # another machine listing the samples in another order agrees


def test_select_keeps_the_dataset_order_and_rejects_duplicate_ids():
    samples = [SimpleNamespace(id=i) for i in "abcde"]
    assert [s.id for s in Shard(0, 2).select(samples)] == ["a", "b", "d"]
    with pytest.raises(ValueError, match="unique"):
        Shard(0, 2).select([SimpleNamespace(id="a"), SimpleNamespace(id="a")])


def test_cost_adds_sessions_and_counts_gpu_seconds_per_gpu():
    earlier = {"cost": {"sessions": [{"host": "n1", "wall_s": 10.0, "gpu_s": 20.0}]}}
    cpu_model = SimpleNamespace(parameters=lambda: iter([SimpleNamespace(device=SimpleNamespace(type="cpu"))]))
    meter = CostMeter.resume(cpu_model, earlier, t0=0.0)
    cost = meter.fields()["cost"]
    assert meter.gpus == 0 and cost["sessions"][-1]["gpu_s"] == 0
    assert cost["wall_s"] == pytest.approx(10.0 + cost["sessions"][-1]["wall_s"]) and cost["gpu_s"] == 20.0
    assert totals([{"host": "a", "wall_s": 1.5, "gpu_s": 3.0}, {"host": "b", "wall_s": 2.0, "gpu_s": 8.0}]) == {
        "wall_s": 3.5, "gpu_s": 11.0, "hosts": ["a", "b"],
        "sessions": [{"host": "a", "wall_s": 1.5, "gpu_s": 3.0}, {"host": "b", "wall_s": 2.0, "gpu_s": 8.0}]}
