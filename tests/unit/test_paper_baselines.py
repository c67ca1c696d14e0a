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
from kvbench.engine.generation import compress, prefill
from kvbench.engine.batching import generate
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


# --- local window and rolling StreamingLLM: what the cache holds after prefill and after every step -------------
def positions_each_step(model, method, ids, budget, steps, positions="original"):
    """Original positions per layer and head after the prefill eviction and after each decode step."""
    history = []
    with AttentionCapture(model) as capture:
        def snap(t, logits):
            history.append([layer.positions[0].tolist() for layer in capture.cache.layers])

        generate(model, None, method, capture, ids, budget, steps, eos_ids=set(), on_logits=snap,
                 positions=positions)
    return history


@pytest.mark.parametrize("positions", ["original", "shift"])
@pytest.mark.parametrize("name,sinks", [("local", 0), ("streamingllm_rolling", 4)])
def test_rolling_windows_hold_sinks_and_the_last_entries_after_every_step(name, sinks, positions):
    n, budget, steps = 50, 16, 25
    model, ids = tiny_model("qwen2", layers=2), prompt(n)
    history = positions_each_step(model, METHODS[name](), ids, budget, steps, positions)
    assert len(history) == steps
    for t, layers in enumerate(history):  # before step t's token is appended: n + t tokens seen so far
        seen = n + t
        expected = list(range(sinks)) + list(range(seen - (budget - sinks), seen))
        for heads in layers:
            if positions == "shift":  # stored as computed (the query's slot); attention sees them at cache slots
                assert all(len(row) == budget for row in heads)
            else:
                assert all(row == expected for row in heads), (t, heads[0])


@pytest.mark.parametrize("kw,first", [({}, 4), ({"n_sink": 2}, 2), ({"recent": 8}, 24 - 8), ({"recent": 20}, 4)])
def test_streamingllm_code_and_paper_splits(kw, first):
    """The code's 4 sinks + B - 4 recent, and PyramidKV's paper text: the last r (alpha) + the first B - r."""
    n, budget = 50, 24
    model, ids = tiny_model("llama", layers=2), prompt(n)
    kept = kept_after_prefill(model, ids, METHODS["streamingllm"](**kw), budget)
    expected = list(range(first)) + list(range(n - (budget - first), n))
    for layer in kept:
        assert all(sorted(row.tolist()) == expected for row in layer)
    with pytest.raises(ValueError, match="budget=8 must be > recent=8"):
        METHODS["streamingllm"](recent=8).check_budget(8)


def test_rolling_windows_compute_no_prefill_scores():
    model, ids = tiny_model("llama", layers=2), prompt(40)
    calls = []
    with AttentionCapture(model) as capture:
        inner = capture._column_sums
        capture._column_sums = lambda *a: calls.append(1) or inner(*a)
        generate(model, None, METHODS["local"](), capture, ids, 8, 2, eos_ids=set())
        assert not calls
        generate(model, None, METHODS["h2o"](), capture, ids, 8, 2, eos_ids=set())
        assert len(calls) == 2  # the spy works: H2O scores both layers


# --- BUZZ with log n ------------------------------------------------------------------------------------------------
def scaled_reference(model, tokens, n_prompt):
    """Logits of each step from a DynamicCache run whose attention is written out here: logits of every layer and
    head times log_512(number of keys), causal mask, float64 softmax."""
    from transformers import DynamicCache

    def attention(module, q, k, v, mask, scaling=None, **kw):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1).double(), v.repeat_interleave(rep, 1).double()
        n_keys, q_len = k.shape[2], q.shape[2]
        logits = (q.double() @ k.transpose(-1, -2)) * scaling * (math.log(n_keys) / math.log(512))
        rows = torch.arange(n_keys - q_len, n_keys)[:, None]
        logits = logits.masked_fill(torch.arange(n_keys)[None, :] > rows, float("-inf"))
        return (logits.softmax(-1) @ v).transpose(1, 2).to(q.dtype), None

    out, cache = [], DynamicCache()
    with attention_function(model, attention):
        logits = model(tokens[:, :n_prompt], past_key_values=cache).logits[:, -1]
        out.append(logits)
        for t in range(n_prompt, tokens.shape[1]):
            out.append(model(tokens[:, t: t + 1], past_key_values=cache,
                             position_ids=torch.tensor([[t]])).logits[:, -1])
    return out


@pytest.mark.parametrize("n", [40, 512])
def test_buzz_logn_scales_every_logit_by_log512_of_the_key_count(n):
    model, ids = tiny_model("llama", layers=2), prompt(n)
    seen = []
    method = METHODS["buzz"](logn=True)
    with AttentionCapture(model) as capture:
        gen = generate(model, None, method, capture, ids, 10_000, 4, eos_ids=set(),  # no eviction: the scale alone
                       on_logits=lambda t, logits: seen.append(logits))
    tokens = torch.cat([ids, torch.tensor([gen.token_ids[:-1]])], dim=1)
    for ours, ref in zip(seen, scaled_reference(model, tokens, n)):
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    with AttentionCapture(model) as capture:
        plain = generate(model, None, METHODS["buzz"](), capture, ids, 10_000, 1, eos_ids=set(),
                         on_logits=lambda t, logits: seen.append(logits))
    same = torch.allclose(seen[-1], seen[0], atol=1e-4)
    assert same == (n == 512)  # at 512 keys the factor is exactly 1
    assert plain.token_ids


def test_buzz_logn_changes_the_selection_scores():
    """The logits BUZZ turns into its accumulated scores are the scaled ones: log_512(n) times the plain ones."""
    from dataclasses import dataclass

    from kvbench.methods.buzz import BUZZ, logn_scale

    assert logn_scale(512) == 1.0 and logn_scale(1) == 0.0 and abs(logn_scale(50) - 0.62710) < 1e-5

    @dataclass
    class Recording(BUZZ):
        def row_score(self, logits, state, decoding):
            seen.append(logits.clone())
            return super().row_score(logits, state, decoding)

    model, ids, n = tiny_model("llama", layers=2), prompt(60), 60
    runs = {}
    for logn in (False, True):
        seen = []
        with AttentionCapture(model) as capture:
            generate(model, None, Recording(logn=logn), capture, ids, 24, 1, eos_ids=set())
        runs[logn] = seen  # the prefill column-score chunks, one per layer
    plain, scaled = runs[False][0], runs[True][0]  # layer 0 (later layers' inputs differ once attention changed)
    finite = torch.isfinite(plain)
    torch.testing.assert_close(scaled[finite], plain[finite] * logn_scale(n), rtol=1e-5, atol=1e-6)


# --- Keyformer: the released runs' budget base, and code_frozen on prompts that fit the budget -------------------
@pytest.mark.parametrize("fraction,expected", [(0.6, 1152), (0.7, 1344), (0.2, 384), (0.9, 1728)])
def test_keyformer_padded_budget_base(fraction, expected):
    """k = int(1920 * pct / 100) as the released code computes it, whatever the real prompt length."""
    method = METHODS["keyformer"](budget_fraction=fraction, padded_length=1920)
    for prompt_len in (300, 1920, 5000):
        state = method.start(prompt_len, None, 128, 0)
        assert state.budget == expected == 1920 * round(fraction * 100) // 100
        assert int(state.budget * method.recent_ratio) == int(expected * 30 / 100)  # w as the code's `recent`


def test_keyformer_code_frozen_chooses_by_score_when_the_prompt_fits():
    method = METHODS["keyformer"](selection="code_frozen", recent_ratio=0.3)
    state = method.start(8, 10, 20, 0)  # k = 10, w = 3; an 8-token prompt fits: no prefill eviction
    state.extra[0] = {}
    assert method.evict(state, 0, torch.rand(1, 1, 8), prefill=True) is None
    # first time over budget (11 entries): the lowest-scored of entries 0..7 goes, not the boundary entry 7
    scores = torch.tensor([[[5.0, 4.0, 0.1, 6.0, 7.0, 3.0, 2.0, 1.0, 9.0, 9.0, 9.0]]])
    assert method.evict(state, 0, scores, prefill=False)[0, 0].tolist() == [0, 1, 3, 4, 5, 6, 7, 8, 9, 10]
    # from then on the set is frozen: the entry leaving the window (index 7) goes whatever its score
    scores = torch.tensor([[[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 99.0, 1.0, 1.0, 1.0]]])
    assert method.evict(state, 0, scores, prefill=False)[0, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 8, 9, 10]
