"""The papers' baselines and variants, each against its defining property recomputed independently:
KVCache-Factory's H2O, the local window, rolling StreamingLLM, BUZZ with log n, Keyformer's budget base and its
code_frozen rule on prompts that fit the budget."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import kvbench.methods  # noqa: F401
from kvbench.cache import KVCache
from kvbench.generation import compress, generate, prefill
from kvbench.methods.decoding import DecodingMethod
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from tests.unit.tiny import attention_function, prompt, tiny_model


def recorded_qk(model, ids):
    """Post-RoPE queries and keys of every layer at prefill, recorded by a reference attention function."""
    seen = {}

    def record(module, q, k, v, mask, scaling=None, **kw):
        seen[module.layer_idx] = (q[0].double(), k[0].double(), scaling)
        return F.scaled_dot_product_attention(q, k.repeat_interleave(q.shape[1] // k.shape[1], 1),
                                              v.repeat_interleave(q.shape[1] // k.shape[1], 1),
                                              is_causal=True).transpose(1, 2), None

    with attention_function(model, record):
        model(ids)
    return seen


def kept_after_prefill(model, ids, method, budget):
    """Original positions kept per layer `[H, k]` right after the prefill compression (as `generate` does it)."""
    cache = KVCache()
    with AttentionCapture(model, window=getattr(method, "window", 0)) as capture:
        state = None
        if isinstance(method, DecodingMethod):
            state = method.start(ids.shape[1], budget, 1, 0)
            capture.column_score = lambda logits: method.row_score(logits, state, decoding=False)
            capture.column_block = method.causal_block(budget)
        prefill(model, ids, cache)
        compress(method, cache, capture, budget, state)
    return [layer.positions[0] for layer in cache.layers]


# --- H2O as KVCache-Factory runs it ------------------------------------------------------------------------------
def factory_h2o_scores(q, k, scaling, window):
    """Hand-written from `H2OKVCluster.update_kv` (KVCache-Factory @ffac160): logits of all n queries over all n
    keys (KV repeated per query head), a causal mask only on the trailing window x window block, softmax over
    all keys, summed over the queries, non-window columns only. Returns [H_q, n - window]."""
    h_q, n = q.shape[0], q.shape[1]
    logits = q @ k.repeat_interleave(h_q // k.shape[0], 0).transpose(-1, -2) * scaling  # [H_q, n, n]
    for i in range(window):
        for j in range(i + 1, window):
            logits[:, n - window + i, n - window + j] = float("-inf")
    return logits.softmax(-1).sum(dim=1)[:, : n - window]


def assert_top(kept_prefix, scores, k):
    top = scores.topk(k).values
    assert torch.allclose(scores[kept_prefix].sort(descending=True).values, top, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("granularity", ["query_head", "kv_head"])
def test_h2o_kvcache_factory_matches_hand_written_rule(granularity):
    n, budget, window = 120, 40, 8
    model, ids = tiny_model("llama", layers=3), prompt(n)
    qk = recorded_qk(model, ids)
    method = METHODS["h2o"](variant="kvcache_factory", recent_size=window, granularity=granularity)
    kept = kept_after_prefill(model, ids, method, budget)
    for layer, positions in enumerate(kept):
        q, k, scaling = qk[layer]
        scores = factory_h2o_scores(q, k, scaling, window)  # [H_q, n - w]
        if granularity == "kv_head":
            scores = scores.view(k.shape[0], -1, scores.shape[-1]).mean(1)
        assert positions.shape == (scores.shape[0], budget)
        for head, row in enumerate(positions):
            assert row[-window:].tolist() == list(range(n - window, n))
            assert_top(row[:-window], scores[head], budget - window)


def test_h2o_kvcache_factory_does_not_evict_while_decoding():
    model, ids = tiny_model("llama", layers=2), prompt(60)
    method = METHODS["h2o"](variant="kvcache_factory", recent_size=8, granularity="query_head")
    with AttentionCapture(model) as capture:
        gen = generate(model, None, method, capture, ids, 24, 6, eos_ids=set())
    assert gen.kept_per_head[0] == [24] * 6  # H_q heads after the one-shot selection
    assert gen.kv_bytes_final > gen.kv_bytes  # then the cache grows with the generated tokens


def test_h2o_kvcache_factory_differs_from_the_causal_scores():
    """The code's mask lets early queries see later keys: the kept sets differ from full-causal column sums."""
    model, ids = tiny_model("llama", layers=2), prompt(120)
    sets = [[p.tolist() for p in kept_after_prefill(model, ids, METHODS["h2o"](variant=v, recent_size=8), 40)]
            for v in ("kvcache_factory", "prefill_only")]
    assert sets[0] != sets[1]


def test_h2o_query_head_needs_the_factory_variant():
    with pytest.raises(ValueError, match="kvcache_factory"):
        METHODS["h2o"](granularity="query_head")
