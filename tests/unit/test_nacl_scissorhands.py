"""NACL and Scissorhands (kvbench/methods/nacl.py, scissorhands.py): their selections equal KVCache-Factory's
reference functions on golden cases (made by scripts/make_kvcache_factory_goldens.py from the reference at the
commit the JSON names, attention computed there eagerly over the full causal matrix), and they free what they evict
in a real generation."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

import kvbench.methods  # noqa: F401
from kvbench.attention.columns import causal_column_sums
from kvbench.cache.kv_cache import KVLayer
from kvbench.engine.batching import generate
from kvbench.methods.base import LayerView
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from tests.unit.tiny import prompt, tiny_model

ROOT = Path(__file__).resolve().parents[2]
GOLDENS = json.loads((ROOT / "tests/fixtures/kvcache_factory/goldens.json").read_text())


def script():
    spec = importlib.util.spec_from_file_location("goldens", ROOT / "scripts/make_kvcache_factory_goldens.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


INPUTS = script().inputs  # the seeded keys and queries the goldens were made from


@pytest.mark.parametrize("case", GOLDENS["nacl"], ids=lambda c: f"seed{c['seed']}")
def test_nacl_keeps_what_the_reference_keeps(case):
    """Proxy rows' attention, protected proxies and sinks, top scores, and (temperature 0) the random draw from a
    generator seeded alike: the same entries per head."""
    keys, queries = INPUTS(case["seed"], case["n"], case["heads"], case["head_dim"])
    method = METHODS["nacl"](window=case["proxy_size"], sink_size=case["sink_size"],
                             random_budget=case["random_budget"], random_temperature=case["random_temperature"],
                             seed=case["seed"])
    method.check_budget(case["budget"])
    view = LayerView(0, 1, keys, keys.flip(-1), queries[:, :, -case["proxy_size"]:], 1 / math.sqrt(case["head_dim"]))
    assert method.select(view, case["budget"])[0].tolist() == case["kept"]


def layer_of(keys: torch.Tensor) -> KVLayer:
    layer = KVLayer()
    layer.update(keys, keys.flip(-1))
    return layer


@pytest.mark.parametrize("case", GOLDENS["scissorhands"], ids=lambda c: f"seed{c['seed']}")
def test_scissorhands_prefill_keeps_what_the_reference_keeps(case):
    """The prompt's importance over the last `history_window` rows (kvbench sums them in chunks from the causal
    logits; the reference from the full attention matrix), then sinks + recent + top: the same entries."""
    keys, queries = INPUTS(case["seed"], case["n"], case["heads"], case["head_dim"])
    method = METHODS["scissorhands"](history_window=case["history_window"], recent_size=case["recent_size"],
                                     sink_size=case["sink_size"])
    sums = causal_column_sums(queries, keys, 1 / math.sqrt(case["head_dim"]),
                              {"s": lambda logits: method.row_score(logits, None, decoding=False)}, chunk=16)
    layer = layer_of(keys)
    method.start(case["n"], case["budget"], 0, seed=0).prefill(0, layer, sums["s"])
    assert layer.positions[0].tolist() == case["kept"]
    assert layer.keys.shape[2] == case["budget"]  # evicted entries are gone from the stored tensors


@pytest.mark.parametrize("case", GOLDENS["scissorhands_decode"], ids=lambda c: f"seed{c['seed']}")
def test_scissorhands_while_decoding_keeps_what_the_reference_keeps(case):
    """Each step's row over the entries held (its own included) updates the importance with `decay`, then the
    layer is evicted back to the budget: after every step, the same original positions as the reference's loop."""
    n, steps, d = case["n"], case["steps"], case["head_dim"]
    keys, queries = INPUTS(case["seed"], n + steps, case["heads"], d)
    method = METHODS["scissorhands"](decay=case["decay"], recent_size=case["recent_size"],
                                     sink_size=case["sink_size"])
    sums = causal_column_sums(queries[:, :, :n], keys[:, :, :n], 1 / math.sqrt(d),
                              {"s": lambda logits: method.row_score(logits, None, decoding=False)})
    layer = layer_of(keys[:, :, :n])
    state = method.start(n, case["budget"], steps, seed=0)
    state.prefill(0, layer, sums["s"])
    for t in range(n, n + steps):
        layer.update(keys[:, :, t:t + 1], keys[:, :, t:t + 1])
        state.decode(0, layer, queries[:, :, t:t + 1], layer.keys, 1 / math.sqrt(d))
    assert layer.positions[0].tolist() == case["kept"]


def test_nacl_random_draw_depends_on_the_seed_and_keeps_the_protected():
    g = torch.Generator().manual_seed(9)
    keys, queries = torch.randn(1, 2, 80, 8, generator=g), torch.randn(1, 2, 8, 8, generator=g)
    view = LayerView(0, 1, keys, keys, queries, 8 ** -0.5)
    draws = {seed: METHODS["nacl"](window=8, sink_size=2, random_budget=10, seed=seed).select(view, 30)
             for seed in (0, 1)}
    assert not torch.equal(draws[0], draws[1])
    for kept in draws.values():
        assert kept.shape == (1, 2, 30)
        assert {0, 1, *range(72, 80)} <= set(kept[0, 0].tolist()) and {0, 1, *range(72, 80)} <= set(kept[0, 1].tolist())


@pytest.mark.parametrize("name, kwargs", [("nacl", dict(window=8, random_budget=4)),
                                          ("scissorhands", dict(recent_size=4, sink_size=2)),
                                          ("scissorhands", dict(selection="prob", history_window=8, decay=0.9))])
def test_a_generation_holds_the_budget_and_frees_the_rest(name, kwargs):
    """A real tiny model: after the prompt each layer stores `budget` entries per head (NACL then grows by one per
    generated token; Scissorhands is back at `budget` after every step), and the bytes it reports are those of the
    entries it stores: 2 (K and V) x heads x entries x head dim x element size."""
    model, budget, held = tiny_model("llama"), 24, []
    method = METHODS[name](**kwargs)
    with AttentionCapture(model, window=method.query_window) as capture:
        def seen(t, logits):
            layers = capture.cache.layers
            held.append([(layer.keys.shape[2], layer.nbytes(), 2 * layer.keys[0].numel() * layer.keys.element_size())
                         for layer in layers])

        gen = generate(model, None, method, capture, prompt(60), budget, 6, on_logits=seen, eos_ids=set())
    assert len(gen.token_ids) == 6 and len(held) == 6
    for t, step in enumerate(held):
        assert [entries for entries, _, _ in step] == [budget if name == "scissorhands" else budget + t] * len(step)
        assert all(nbytes == counted for _, nbytes, counted in step)


def test_the_grid_launcher_equals_the_basic_one(tmp_path):
    """NACL (the shared window queries), Scissorhands with a history window and decay (its own prefill scorer) and
    MiniCache (merging its copy of the shared prefill) decode together from one prefill per sample; every record
    equals the basic launcher's."""
    from tests.unit.test_cli import grid_here, run_here
    from tests.unit.test_grid import outputs

    common = ["model=tiny_llama", "budget=40", "report=false", "dataset.context_lengths=[300]",
              "dataset.depth_percents=[50]", "dataset.metrics=[pyramidkv_recall]", "dataset.max_new_tokens=4"]
    methods = [["method=nacl", "method.window=8", "method.random_budget=4"],
               ["method=scissorhands", "method.history_window=16", "method.decay=0.8", "method.recent_size=4"],
               ["method=minicache", "method.start_layer=0"]]
    for overrides in methods:
        run_here(*common, *overrides, results=tmp_path / "basic")
    grid_here([[*common, *overrides, "batch_size=3"] for overrides in methods], tmp_path / "grid")
    expected, got = outputs(tmp_path / "basic"), outputs(tmp_path / "grid")
    assert len(expected) == 3 and all("error" not in r for recs, _ in expected.values() for r in recs)
    assert all(r["kv_bytes"] < r["full_kv_bytes"] for recs, _ in expected.values() for r in recs)
    assert got == expected
