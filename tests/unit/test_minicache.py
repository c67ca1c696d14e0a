"""MiniCache (kvbench/methods/minicache.py, kvbench/cache/merged_layers.py): a pair's states read back equal
KVCache-Factory's restore on golden cases (scripts/make_kvcache_factory_goldens.py ran the reference's
`compress_minicache_pair` and `restore_minicache_pair`), the bytes held are the merged storage's (hand-counted), and
a real generation attends what the merged storage reads back."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

import kvbench.methods  # noqa: F401
from kvbench.cache.kv_cache import KVLayer
from kvbench.cache.merged_layers import merge_pair, merge_states
from kvbench.engine.batching import generate
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from tests.unit.tiny import prompt, tiny_model

ROOT = Path(__file__).resolve().parents[2]
CASES = json.loads((ROOT / "tests/fixtures/kvcache_factory/goldens.json").read_text())["minicache"]


def pair_inputs(case: dict):
    spec = importlib.util.spec_from_file_location("goldens", ROOT / "scripts/make_kvcache_factory_goldens.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script.pair_inputs(case["seed"], case["n"], case["heads"], case["head_dim"], case["noise"])


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"seed{c['seed']}")
def test_states_read_back_equal_the_reference_restore(case):
    previous, current = pair_inputs(case)
    merged = merge_states(previous, current, case["interpolation"], case["retention_ratio"])
    assert merged.retained_idx[0].tolist() == case["retained"]  # the most distinct tokens, per head
    for side, name in ((0, "previous"), (1, "current")):
        torch.testing.assert_close(merged.restore(side)[0], torch.tensor(case[name]), rtol=1e-5, atol=1e-5)
        kept = merged.retained_idx.long()
        restored = merged.restore(side).gather(2, kept[..., None].expand(*kept.shape, case["head_dim"]))
        original = (previous, current)[side].gather(2, kept[..., None].expand(*kept.shape, case["head_dim"]))
        assert torch.equal(restored, original)  # retained tokens come back exactly


def test_a_pair_holds_the_merged_storage_bytes_counted_once():
    """n = 40 tokens, 2 heads, D = 16, fp32, ratio 0.1: per K and per V the pair holds one direction (n x D), two
    magnitude columns (n each), ceil(4.0) = 4 retained tokens of both layers (2 x 4 x D) and 4 int32 indices, per
    head; the two dense layers held 2 x n x D each."""
    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(2):
        layer = KVLayer()
        layer.update(torch.randn(1, 2, 40, 16, generator=g), torch.randn(1, 2, 40, 16, generator=g))
        layers.append(layer)
    dense = sum(layer.nbytes() for layer in layers)
    assert dense == 2 * 2 * (2 * 40 * 16) * 4
    previous, current = merge_pair(*layers, interpolation=0.6, retention_ratio=0.1)
    per_states = 2 * (40 * 16 * 4 + 2 * 40 * 4 + 2 * 4 * 16 * 4 + 4 * 4)  # heads x (direction, mags, kept, idx)
    assert previous.nbytes() + current.nbytes() == 2 * per_states  # K and V
    assert previous.nbytes() == 2 * 2 * (40 * 4 + 4 * 16 * 4)  # its magnitudes and retained tokens only
    previous.update(torch.ones(1, 2, 1, 16), torch.ones(1, 2, 1, 16))  # a generated token: full precision
    assert previous.nbytes() == 2 * 2 * (40 * 4 + 4 * 16 * 4) + 2 * 2 * 16 * 4
    assert previous.get_seq_length() == 41 and previous.entries_per_head() == [41, 41]


def test_a_generation_attends_what_the_merged_storage_reads_back():
    """The tiny model (4 layers, start_layer 2: one pair) generates with MiniCache; its logits equal those of a
    generation whose cache holds, in the merged layers, the states read back from an independent merge of the
    same prefill (a dense cache: no merged storage involved), and differ from the full cache's."""
    model, ids = tiny_model("llama", layers=4), prompt(50)
    method = METHODS["minicache"](start_layer=2, retention_ratio=0.1)
    assert method.pairs(4) == [(2, 3)] and METHODS["minicache"]().pairs(30) == [(15, 16), (17, 18), (19, 20),
                                                                               (21, 22), (23, 24), (25, 26), (27, 28)]

    def run(method, edit=None):
        seen, types = [], []
        with AttentionCapture(model, window=method.query_window) as capture:
            def on_logits(t, logits):
                if t == 0 and edit is not None:
                    edit(capture.cache)
                seen.append(logits.clone())
                types.append([type(layer).__name__ for layer in capture.cache.layers])
            generate(model, None, method, capture, ids, None, 5, on_logits=on_logits, eos_ids=set())
        return seen, types

    merged, types = run(method)
    assert types[-1] == ["KVLayer", "KVLayer", "MergedLayer", "MergedLayer"]

    def read_back(cache):  # the first step's logits came from the full prompt: later steps see the read-back
        keys = merge_states(cache.layers[2].keys, cache.layers[3].keys, 0.6, 0.1)
        values = merge_states(cache.layers[2].values, cache.layers[3].values, 0.6, 0.1)
        for side, i in ((0, 2), (1, 3)):
            n = keys.direction.shape[2]
            layer = cache.layers[i]
            layer.keys = torch.cat([keys.restore(side), layer.keys[:, :, n:]], dim=-2)
            layer.values = torch.cat([values.restore(side), layer.values[:, :, n:]], dim=-2)

    unmerged = METHODS["minicache"](start_layer=4)  # no pair: the dense cache stays (the edit reaches its layers)
    full, types = run(unmerged)
    assert types[-1] == ["KVLayer"] * 4
    edited, _ = run(unmerged, edit=read_back)
    assert torch.equal(merged[0], full[0])  # the prompt's own forward is exact
    for a, b in zip(merged[1:], edited[1:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(merged[-1], full[-1], atol=1e-5)  # merging changes the logits: the check can fail
