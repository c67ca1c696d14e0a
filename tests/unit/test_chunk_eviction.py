"""Decode-time evictors when a chunk is fed on top of the compressed cache (query=agnostic's question, a turn).

The chunk's rows must add their attention to the accumulated scores, as every row of a real H2O system does, and
the cache is then evicted to the budget. Checked against an eager recomputation: one forward over the uncompressed
prompt whose question rows see only the context entries the prefill kept (and the question causally), with the
softmax written out here; the expected scores are the prefill's plus the column sums of those rows, and the kept
set must follow the method's rule over them (written again here, ties allowed)."""
from __future__ import annotations

import copy

import pytest
import torch

import kvbench.methods  # noqa: F401
from kvbench.engine.columns import causal_column_sums
from kvbench.engine.generation import feed, prepare
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from tests.unit.tiny import attention_function, prompt, tiny_model

N, Q, BUDGET = 120, 14, 40


def question_rows(model, ids, n_context, kept) -> dict[int, torch.Tensor]:
    """Per layer, the question rows' softmax probabilities `[H_q, Q, N]` of one eager forward in which those rows
    see only `kept[layer][head]` of the context (context rows: the whole context causally, as its prefill)."""
    n_heads, probs = model.config.num_attention_heads, {}

    def eager(module, q, k, v, mask, scaling=None, **kw):
        n = k.shape[2]
        k, v = k.repeat_interleave(n_heads // k.shape[1], 1), v.repeat_interleave(n_heads // v.shape[1], 1)
        allowed = torch.ones(n, n, dtype=torch.bool).tril().repeat(n_heads, 1, 1)
        per_head = kept[module.layer_idx]
        for hq in range(n_heads):
            seen = torch.zeros(n, dtype=torch.bool)
            seen[per_head[hq * len(per_head) // n_heads]] = True
            seen[n_context:] = True
            allowed[hq, n_context:] &= seen
        logits = (q[0].double() @ k[0].double().transpose(-1, -2)) * scaling
        p = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
        probs[module.layer_idx] = p[:, n_context:]
        return (p.to(v.dtype) @ v[0]).transpose(0, 1)[None].contiguous(), None

    with attention_function(model, eager):
        model(ids)
    return probs


def run(name: str, **kwargs):
    """The context compressed alone (state and kept positions copied), then the question fed on top."""
    model, ids = tiny_model("llama"), prompt(N)
    method = METHODS[name](**kwargs)
    with AttentionCapture(model) as capture:
        prepared = prepare(model, method, capture, ids[:, :N - Q], BUDGET, 4)
        before = copy.deepcopy(prepared.state.scores)
        kept = [list(layer.positions[0].clone()) for layer in prepared.cache.layers]
        feed(model, capture, prepared.cache, ids[:, N - Q:])
    return model, ids, prepared, before, kept


def expected_totals(model, ids, before, kept, last_row_only=False) -> list[torch.Tensor]:
    """Per layer `[H_kv, len(kept) + Q]`: the prefill scores of the kept context entries plus the question rows'
    column sums (mean over each KV group's query heads), the question's own entries after them."""
    probs = question_rows(model, ids, N - Q, kept)
    totals = []
    for i, per_head in enumerate(kept):
        p = probs[i][:, -1:] if last_row_only else probs[i]  # [H_q, rows, N]
        sums = p.sum(1).view(len(per_head), -1, N).mean(1)  # [H_kv, N]
        rows = []
        for h, positions in enumerate(per_head):
            entries = torch.cat([positions, torch.arange(N - Q, N)])
            old = torch.zeros(len(entries), dtype=torch.float64)
            if not last_row_only:
                old[:len(positions)] = before[i][0, h].double()
            rows.append((old + sums[h, entries], entries))
        totals.append(rows)
    return totals


def test_h2o_adds_the_question_rows_to_its_scores_and_evicts_to_the_budget():
    model, ids, prepared, before, kept = run("h2o")
    recent = BUDGET // 2
    for i, layer in enumerate(prepared.cache.layers):
        scores = prepared.state.scores[i][0]
        assert layer.keys.shape[-2] == BUDGET and scores.shape[-1] == BUDGET
        for h, (total, entries) in enumerate(expected_totals(model, ids, before, kept)[i]):
            now = layer.positions[0, h]
            torch.testing.assert_close(now[-recent:], entries[-recent:])  # the last `recent` entries stay
            where = {int(p): j for j, p in enumerate(entries)}
            got = total[[where[int(p)] for p in now]]
            torch.testing.assert_close(scores[h].double(), got, rtol=1e-4, atol=1e-5)
            heavy = set(now[:-recent].tolist())
            dropped = [total[j] for j, p in enumerate(entries[:-recent].tolist()) if p not in heavy]
            assert min(got[:-recent]) >= max(dropped) - 1e-5  # the heavy hitters: the top scores (ties allowed)


def test_tova_keeps_the_top_of_the_questions_last_row():
    model, ids, prepared, before, kept = run("tova")
    for i, layer in enumerate(prepared.cache.layers):
        rows = expected_totals(model, ids, before, kept, last_row_only=True)[i]
        entries = rows[0][1]
        mean = torch.stack([total for total, _ in rows]).mean(0)  # one set per layer from the all-head mean
        now = layer.positions[0, 0].tolist()
        assert layer.keys.shape[-2] == BUDGET and all(layer.positions[0, h].tolist() == now for h in range(len(rows)))
        chosen = [j for j, p in enumerate(entries.tolist()) if p in set(now)]
        others = [j for j in range(len(entries)) if j not in chosen]
        assert min(mean[chosen]) >= max(mean[others]) - 1e-5
        torch.testing.assert_close(prepared.state.scores[i][0].double(),
                                   torch.stack([total[chosen] for total, _ in rows]), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name, kwargs", [("keyformer", {"logit_adjustment": "none"}),
                                          ("keyformer", {"score": "shared"}), ("buzz", {}),
                                          ("streamingllm_rolling", {})])
def test_other_evictors_score_the_chunk_and_hold_the_budget(name, kwargs):
    _, _, prepared, _, _ = run(name, **kwargs)
    for i, layer in enumerate(prepared.cache.layers):
        n = layer.keys.shape[-2]
        assert n <= BUDGET and prepared.state.scores[i].shape[-1] == n
        assert layer.positions[0, 0, -1] == N - 1  # the question's last token is recent: kept
    if kwargs.get("score") == "shared":  # one decision for every layer
        first = prepared.cache.layers[0].positions
        assert all(torch.equal(layer.positions, first) for layer in prepared.cache.layers)


@pytest.mark.parametrize("offset, block", [(0, None), (9, None), (0, 4)])
def test_causal_column_sums_at_an_offset_match_an_eager_sum(offset, block):
    """The one helper of the prefill (offset 0, KVCache-Factory's trailing block) and of a fed chunk (rows at
    positions offset..offset+q-1 over keys 0..offset+q-1), in blocks of 3 rows, against float64 written out here:
    GQA (query head h reads KV head h // 3), soft cap, then the causal mask."""
    gen = torch.Generator().manual_seed(0)
    q, n_keys, scale, cap = 7, offset + 7, 0.3, 5.0
    query, key = torch.randn(1, 6, q, 8, generator=gen), torch.randn(1, 2, n_keys, 8, generator=gen)
    sums = causal_column_sums(query, key, scale, {"p": lambda x: x.softmax(-1), "exp": lambda x: x.exp()},
                              offset=offset, softcap=cap, block=block, chunk=3)
    logits = torch.einsum("hqd,hkd->hqk", query[0].double(), key[0].double().repeat_interleave(3, 0)) * scale
    logits = cap * torch.tanh(logits / cap)
    rows = torch.arange(offset, offset + q)[:, None]
    future = torch.arange(n_keys)[None, :] > rows
    if block is not None:
        future &= rows >= n_keys - block
    masked = logits.masked_fill(future, float("-inf"))
    torch.testing.assert_close(sums["p"][0].double(), masked.softmax(-1).sum(1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sums["exp"][0].double(), masked.exp().sum(1), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="need"):
        causal_column_sums(query, key[:, :, 1:], scale, {}, offset=offset)
