"""Compressing each layer inside the prefill forward (`compress_after=layer`): the same entries survive as when the
whole prefill runs first, every decode step's logits are bit-identical, and the KV held at once is bounded by the
compressed cache plus one full layer (the hand-computed peak), where the old order holds the whole prompt cache."""
from __future__ import annotations

import pytest
import torch

import kvbench.methods  # noqa: F401
from kvbench.engine.batching import generate
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from tests.unit.tiny import prompt, tiny_model

N, NEW = 160, 6
CASES = [  # (method, its knobs, budget, positions): every prefill-time selection kind and the decode-time evictors
    ("snapkv", {"window": 8}, 40, "original"),
    ("snapkv", {"window": 8, "granularity": "query_head"}, 40, "original"),
    ("pyramidkv", {}, 40, "original"),
    ("adakv", {"window": 8}, 40, "original"),
    ("ada_pyramidkv", {"window": 8}, 48, "original"),
    ("streamingllm", {}, 40, "shift"),
    ("h2o", {}, 40, "original"),
    ("keyformer", {}, 40, "original"),
    ("buzz", {}, 40, "shift"),
    ("knorm", {}, 40, "original"),
    ("tova", {}, 40, "original"),
    ("expected_attention", {"window": 8}, 40, "original"),
]


def kept_positions(cache) -> list[torch.Tensor]:
    return [layer.flat_positions if layer.is_varlen else layer.positions for layer in cache.layers]


def run(model, ids, name, knobs, budget, positions, order):
    method = METHODS[name](**knobs)
    logits, kept = [], []

    def on_logits(t, step_logits):
        logits.append(step_logits.clone())
        if t == 0 and capture.cache is not None:  # the compressed cache, before the first decode step
            kept.extend(p.clone() for p in kept_positions(capture.cache))

    window = method.query_window
    with AttentionCapture(model, window=window) as capture:
        gen = generate(model, None, method, capture, ids, budget, NEW, eos_ids=set(), on_logits=on_logits,
                       positions=positions, seed=7, compress_after=order)
    return gen, logits, kept


@pytest.mark.parametrize("name,knobs,budget,positions", CASES, ids=lambda v: v if isinstance(v, str) else None)
def test_in_forward_compression_keeps_the_same_entries_and_logits(name, knobs, budget, positions):
    model, ids = tiny_model("llama", layers=3), prompt(N)
    late, late_logits, late_kept = run(model, ids, name, knobs, budget, positions, "prefill")
    early, early_logits, early_kept = run(model, ids, name, knobs, budget, positions, "layer")
    assert len(early_kept) == 3 and all(torch.equal(a, b) for a, b in zip(early_kept, late_kept))
    assert len(early_logits) == NEW and all(torch.equal(a, b) for a, b in zip(early_logits, late_logits))
    assert early.token_ids == late.token_ids and early.kept_per_head == late.kept_per_head
    assert (early.kv_bytes, early.full_kv_bytes) == (late.kv_bytes, late.full_kv_bytes)
    bound = early.kv_bytes + early.full_kv_bytes // 3 + max(early.kv_bytes_per_layer)  # + one full layer + a gather
    assert early.peak_kv_bytes <= max(bound, early.kv_bytes_final)
    assert late.peak_kv_bytes >= late.full_kv_bytes and late.peak_kv_bytes > early.peak_kv_bytes


def test_peak_is_the_compressed_layers_so_far_plus_one_full_layer():
    """Hand-computed for PyramidKV (different sizes per layer): while layer i is compressed, layers < i hold their
    kept entries and layer i its full K/V plus the gathered copy; afterwards decoding appends one entry per step."""
    model, ids = tiny_model("llama", layers=4), prompt(N)
    gen, _, _ = run(model, ids, "pyramidkv", {}, 40, "original", "layer")
    entry = 2 * 2 * 16 * 4  # K and V x 2 KV heads x head_dim 16 x fp32
    kept = gen.kv_bytes_per_layer
    full_layer = N * entry
    assert gen.full_kv_bytes == 4 * full_layer and len(set(kept)) > 1
    during = max(sum(kept[:i]) + full_layer + kept[i] for i in range(4))
    after = sum(kept) + 4 * (NEW - 1) * entry  # the last token is sampled, never fed back
    assert gen.peak_kv_bytes == max(during, after)
    assert gen.peak_kv_bytes <= gen.kv_bytes + full_layer + max(kept)
    late, _, _ = run(model, ids, "pyramidkv", {}, 40, "original", "prefill")
    assert late.peak_kv_bytes == gen.full_kv_bytes + kept[0]  # everything, then layer 0's gather on top of it


def test_storage_methods_and_full_keep_the_old_order():
    model, ids = tiny_model("llama", layers=3), prompt(N)
    gen, _, _ = run(model, ids, "full", {}, None, "original", "layer")
    assert gen.peak_kv_bytes == gen.kv_bytes_final >= gen.full_kv_bytes
    with pytest.raises(ValueError, match="compress_after='early' is not one of layer, prefill"):
        run(model, ids, "snapkv", {"window": 8}, 40, "original", "early")
