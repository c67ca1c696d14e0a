"""Ada-KV: allocation (hand-worked and against an independent re-implementation) and the variable-length cache
(varlen attention = padded+mask attention = dense recompute over the kept indices; bytes = kept entries)."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import kvbench.methods  # noqa: F401
from kvbench.attention.decode import attend, decode_attention
from kvbench.cache.kv_cache import KVLayer
from kvbench.cache.rows import append
from kvbench.cache.varlen import VarlenLayer, VarlenRows
from kvbench.engine.batching import generate
from kvbench.methods.adakv import ada_head_budgets, ada_select_kvpress
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from tests.unit.tiny import prompt, tiny_model


# --- allocation -----------------------------------------------------------------------------------------------
def test_hand_worked_allocations():
    concentrated = torch.tensor([[0.9, 0.8, 0.7, 0.6], [0.1, 0.05, 0.04, 0.03]])
    # global top-4 all fall in head 0: f = [4, 0]; floor = int(alpha * 2)
    assert ada_head_budgets(concentrated, 2, alpha=0.5).tolist() == [3, 1]  # round(2 + 1), round(0 + 1)
    assert ada_head_budgets(concentrated, 2, alpha=0.2).tolist() == [3, 0]  # round(3.2 + 0), 0
    assert ada_head_budgets(concentrated, 2, alpha=0.0).tolist() == [4, 0]
    # f = [5, 1], B' = 3, alpha 0.5: round(2.5 + 1) = 4 and round(0.5 + 1) = 2: halves go to even
    ties = torch.tensor([[9, 8, 7, 6, 5, 0, 0, 0], [4.5, 0, 0, 0, 0, 0, 0, 0]])
    assert ada_head_budgets(ties, 3, alpha=0.5).tolist() == [4, 2]


def reference_budgets(scores: list[list[float]], n_select: int, alpha: float) -> list[int]:
    """Independent: sort (score, head) pairs, count the winners per head, apply the formula with Python's round
    (also half to even)."""
    pairs = sorted(((s, h) for h, row in enumerate(scores) for s in row), reverse=True)[: len(scores) * n_select]
    counts = [sum(1 for _, h in pairs if h == head) for head in range(len(scores))]
    return [min(round(c * (1 - alpha) + int(n_select * alpha)), len(scores[0])) for c in counts]


@pytest.mark.parametrize("seed", range(20))
def test_allocation_matches_independent_reimplementation(seed):
    rng = random.Random(seed)
    n_heads, length, n_select = rng.randint(2, 8), rng.randint(10, 60), rng.randint(1, 9)
    alpha = rng.choice([0.0, 0.05, 0.2, 0.5, 1.0])
    scores = [[rng.random() ** rng.randint(1, 6) for _ in range(length)] for _ in range(n_heads)]
    got = ada_head_budgets(torch.tensor(scores, dtype=torch.float64), n_select, alpha).tolist()
    assert got == reference_budgets(scores, n_select, alpha)
    assert abs(sum(got) - n_heads * n_select) <= n_heads  # the spec's tolerance: rounding drift within +-H


def test_kvpress_allocation_hand_worked():
    scores = torch.tensor([[5.0, 4.0, 3.0, 2.0], [0.5, 0.4, 0.3, 0.2]])  # prefix scores; window of 1
    kept = ada_select_kvpress(scores, n_keep=2, window=1, alpha=0.5)  # n_safe = 1: only the window is protected
    # global top-4 over [[5,4,3,2,W],[.5,.4,.3,.2,W]] with both windows protected: W, W, 5, 4
    assert [k.tolist() for k in kept] == [[0, 1, 4], [4]]


# --- the variable-length cache ---------------------------------------------------------------------------------
def random_varlen(n_kv=2, n=40, d=8, per_query_head=1, decode=3, seed=0):
    torch.manual_seed(seed)
    dense = KVLayer()
    dense.update(torch.randn(1, n_kv, n, d), torch.randn(1, n_kv, n, d))
    keys, values = dense.keys.clone(), dense.values.clone()
    gen = torch.Generator().manual_seed(seed)
    idx = [torch.randperm(n, generator=gen)[: int(torch.randint(1, n, (1,), generator=gen))].sort().values
           for _ in range(n_kv * per_query_head)]
    layer = VarlenLayer.from_selection(dense, idx)
    new = [(torch.randn(1, n_kv, 1, d), torch.randn(1, n_kv, 1, d)) for _ in range(decode)]
    for k, v in new:
        layer.update(k, v)
    return layer, keys, values, idx, new


def dense_recompute(q, keys, values, idx, new, scaling):
    """Per query head: softmax over exactly its kept entries + the decoded tokens, in float64."""
    n_q, d = q.shape[1], q.shape[-1]
    rep_sel = len(idx) // keys.shape[1]
    out = []
    for hq in range(n_q):
        sel = hq * len(idx) // n_q  # the stored head this query head reads
        kv = sel // rep_sel
        k = torch.cat([keys[0, kv, idx[sel]]] + [nk[0, kv] for nk, _ in new]).double()
        v = torch.cat([values[0, kv, idx[sel]]] + [nv[0, kv] for _, nv in new]).double()
        p = ((q[0, hq, 0].double() @ k.T) * scaling).softmax(-1)
        out.append(p @ v)
    return torch.stack(out).view(1, 1, n_q, d)


def padded_mask_attention(q, layer, scaling):
    """Padded to the longest head + a key mask, through torch's SDPA (what a naive per-head cache would do)."""
    n_heads, d = len(layer.head_lens), q.shape[-1]
    longest = int(layer.head_lens.max())
    k = torch.zeros(n_heads, longest, d)
    v = torch.zeros(n_heads, longest, d)
    mask = torch.zeros(n_heads, longest, dtype=torch.bool)
    for h in range(n_heads):
        s, e = int(layer.cu[h]), int(layer.cu[h + 1])
        k[h, : e - s], v[h, : e - s], mask[h, : e - s] = layer.flat_keys[s:e], layer.flat_values[s:e], True
    k, v = torch.cat([k, layer.keys[0]], 1), torch.cat([v, layer.values[0]], 1)
    mask = torch.cat([mask, torch.ones(n_heads, layer.keys.shape[2], dtype=torch.bool)], 1)
    group = q.shape[1] // n_heads
    k, v, mask = (x.repeat_interleave(group, 0) for x in (k, v, mask))
    out = F.scaled_dot_product_attention(q[0], k, v, attn_mask=mask[:, None, :], scale=scaling)
    return out.view(1, 1, -1, d)


@pytest.mark.parametrize("per_query_head", [1, 3])
@pytest.mark.parametrize("seed", range(4))
def test_varlen_attention_equals_padded_mask_and_dense_recompute(per_query_head, seed):
    layer, keys, values, idx, new = random_varlen(per_query_head=per_query_head, seed=seed)
    q = torch.randn(1, 6, 1, 8)  # 6 query heads over 2 KV heads (GQA 3:1)
    ours = attend(layer, q, 0.35)
    torch.testing.assert_close(ours, padded_mask_attention(q, layer, 0.35), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.double(), dense_recompute(q, keys, values, idx, new, 0.35), rtol=1e-5,
                               atol=1e-6)


def test_varlen_bytes_are_exactly_the_kept_entries():
    layer, _, _, idx, _ = random_varlen(decode=0)
    assert layer.nbytes() == sum(len(i) for i in idx) * 2 * 8 * 4  # K and V, head_dim 8, fp32: no padding
    assert layer.entries_per_head() == [len(i) for i in idx]
    layer.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))  # one decoded token per KV head
    assert layer.nbytes() == (sum(len(i) for i in idx) + 2) * 2 * 8 * 4


def test_decode_appends_without_copying_the_flattened_prompt():
    layer, *_ = random_varlen(decode=0)
    before = layer.flat_keys.data_ptr()
    for _ in range(3):
        layer.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
    assert layer.flat_keys.data_ptr() == before and layer.keys.shape[2] == 3


def test_samples_in_one_pool_hold_attend_and_leave_as_their_own_layers():
    """Batched decoding's `VarlenRows`: three samples' per-head layers (different head lengths) in one flat pool, their
    decoded tokens in shared rows (one sample skips a step). Each holds its own bytes and entries; one call attends
    all three as a float64 recomputation over each one's own kept entries does; a sample leaving takes exactly its
    entries out of the pool, and one detaching becomes a `VarlenLayer` that attends as before."""
    references = [random_varlen(decode=0, seed=s) for s in range(3)]
    pool = VarlenRows(random_varlen(decode=0, seed=0)[0], capacity=64)
    pooled = [pool.take(random_varlen(decode=0, seed=s)[0]) for s in range(3)]
    g, new = torch.Generator().manual_seed(5), [[], [], []]
    for step in range(3):
        for i in ([0, 1, 2] if step < 2 else [0, 2]):
            k, v = torch.randn(1, 2, 1, 8, generator=g), torch.randn(1, 2, 1, 8, generator=g)
            references[i][0].update(k, v)
            append([pooled[i]], [k[0]], [v[0]])
            new[i].append((k, v))
    q = torch.randn(3, 6, 1, 8, generator=g)

    def assert_attends_as_alone(rows):
        out = decode_attention(q, [pool.decode_kv()], 0.35)[0]
        for i in rows:
            _, keys, values, idx, _ = references[i]
            expected = dense_recompute(q[i:i + 1], keys, values, idx, new[i], 0.35)
            torch.testing.assert_close(out[i:i + 1].double(), expected, rtol=1e-5, atol=1e-6)

    for layer, (reference, *_) in zip(pooled, references):
        assert layer.nbytes() == reference.nbytes() and layer.entries_per_head() == reference.entries_per_head()
    assert pool.flat_keys.shape[0] == sum(len(i) for _, _, _, idx, _ in references for i in idx)  # no padding
    assert_attends_as_alone([0, 1, 2])
    held = pool.flat_keys.shape[0]
    pooled[1].release()
    assert pool.flat_keys.shape[0] == held - sum(len(i) for i in references[1][3])
    assert_attends_as_alone([0, 2])
    alone = pooled[2].detach()
    assert type(alone) is VarlenLayer and alone.nbytes() == references[2][0].nbytes()
    _, keys, values, idx, _ = references[2]
    torch.testing.assert_close(attend(alone, q[2:3], 0.35).double(),
                               dense_recompute(q[2:3], keys, values, idx, new[2], 0.35), rtol=1e-5, atol=1e-6)
    assert pool.flat_keys.shape[0] == sum(len(i) for i in references[0][3]) and pool.owners[1:] == [None, None]
    assert_attends_as_alone([0])


# --- through the model --------------------------------------------------------------------------------------------
def run(model, name, budget, ids, **kw):
    method, seen = METHODS[name](**kw), []
    with AttentionCapture(model, window=getattr(method, "window", 0)) as capture:
        gen = generate(model, None, method, capture, ids, budget, 8, eos_ids=set(),
                       on_logits=lambda t, logits: seen.append(logits.clone()))
    return gen, seen


@pytest.mark.parametrize("name", ["adakv", "ada_pyramidkv"])
def test_budget_at_or_above_prompt_equals_full_and_first_token_always_does(name):
    model, ids = tiny_model("qwen2"), prompt(120)
    full, full_logits = run(model, "full", None, ids)
    same, same_logits = run(model, name, 120, ids, window=8)
    assert same.token_ids == full.token_ids and all(torch.equal(a, b) for a, b in zip(same_logits, full_logits))
    small, small_logits = run(model, name, 40, ids, window=8)
    assert torch.equal(small_logits[0], full_logits[0])
    assert small.kv_bytes < full.kv_bytes


@pytest.mark.parametrize("granularity,alpha", [("kv_head", 0.2), ("query_head", 0.5)])
def test_model_bytes_and_budget_accounting(granularity, alpha):
    model, ids = tiny_model("llama"), prompt(200)
    gen, _ = run(model, "adakv", 48, ids, window=8, granularity=granularity, alpha=alpha)
    heads = [len(layer) for layer in gen.kept_per_head]
    expected_heads = model.config.num_attention_heads if granularity == "query_head" else 2
    assert heads == [expected_heads] * model.config.num_hidden_layers
    per_entry = 2 * 16 * 4
    assert gen.kv_bytes == sum(map(sum, gen.kept_per_head)) * per_entry
    for layer in gen.kept_per_head:
        assert abs(sum(layer) - 48 * len(layer)) <= len(layer)  # +-H rounding drift
    assert len({n for layer in gen.kept_per_head for n in layer}) > 1  # budgets really differ between heads
