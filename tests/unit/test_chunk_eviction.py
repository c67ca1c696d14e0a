"""Decode-time evictors when a chunk is fed on top of the compressed cache (query=agnostic's question, a turn).

The chunk's rows must add their row scores to the accumulated scores, as every row of a real H2O system does, and
the cache is then evicted to the budget. Checked against an eager recomputation: one forward over the uncompressed
prompt whose question rows see only the context entries the prefill kept (and the question causally), in float64,
with each method's row score written out here (softmax; Keyformer's Gumbel-noise softmax at its temperature, with the
sample's noise stream drawn again; BUZZ's softmax of log n-scaled logits); the expected scores are the prefill's plus
the column sums of those rows, and the kept set must follow the method's rule over them (written again here)."""
from __future__ import annotations

import copy
import math

import pytest
import torch

import kvbench.methods  # noqa: F401
from kvbench.attention.columns import causal_column_sums
from kvbench.engine.generation import feed, prepare
from kvbench.methods.buzz import BUZZ
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from tests.unit.tiny import attention_function, prompt, tiny_model

N, Q, BUDGET, MAX_NEW = 120, 14, 40, 4


def question_logits(model, ids, n_context, kept, factor=None) -> dict[int, torch.Tensor]:
    """Per layer, the question rows' logits `[H_q, Q, N]` (float64, -inf where a row does not see the key) of one
    eager forward in which those rows see only `kept[layer][head]` of the context (context rows: the whole context
    causally, as its prefill). `factor(layer)`: `[N]`, each row's factor on its logits (BUZZ's log n), applied to the
    attention itself too, as the model applies it."""
    n_heads, rows = model.config.num_attention_heads, {}

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
        if factor is not None:
            logits = logits * factor(module.layer_idx)[:, None]
        logits = logits.masked_fill(~allowed, float("-inf"))
        rows[module.layer_idx] = logits[:, n_context:]
        return (logits.softmax(-1).to(v.dtype) @ v[0]).transpose(0, 1)[None].contiguous(), None

    with attention_function(model, eager):
        model(ids)
    return rows


def question_rows(model, ids, n_context, kept) -> dict[int, torch.Tensor]:
    """Per layer, the question rows' softmax probabilities `[H_q, Q, N]` (see `question_logits`)."""
    return {i: logits.softmax(-1) for i, logits in question_logits(model, ids, n_context, kept).items()}


def run(name: str, step: int = 0, **kwargs):
    """The context compressed alone (state and kept positions copied), then the question fed on top; `step`: the
    decode steps the state counts when the question comes (a later turn's chunk). Also returns the state's noise
    stream as the feed found it."""
    model, ids = tiny_model("llama"), prompt(N)
    method = METHODS[name](**kwargs)
    with AttentionCapture(model) as capture:
        prepared = prepare(model, method, capture, ids[:, :N - Q], BUDGET, MAX_NEW, seed=5)
        before = copy.deepcopy(prepared.state.scores)
        kept = [list(layer.positions[0].clone()) for layer in prepared.cache.layers]
        prepared.state.step = step
        noise = torch.Generator().set_state(prepared.state.generator.get_state())
        feed(model, capture, prepared.cache, ids[:, N - Q:])
    return model, ids, prepared, before, kept, noise


def expected_totals(model, ids, before, kept, last_row_only=False, probs=None) -> list[list]:
    """Per layer and KV head (total `[len(kept) + Q]`, entries): the prefill scores of the kept context entries plus
    the question rows' column sums of `probs` (default: the softmax rows; mean over each KV group's query heads),
    the question's own entries after them."""
    probs = question_rows(model, ids, N - Q, kept) if probs is None else probs
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


def check_heavy_recent(prepared, totals, recent):
    """Every layer holds the budget: the last `recent` entries and the top of the others by expected total (ties
    allowed), with the expected totals as scores."""
    for i, layer in enumerate(prepared.cache.layers):
        scores = prepared.state.scores[i][0]
        assert layer.keys.shape[-2] == BUDGET and scores.shape[-1] == BUDGET
        for h, (total, entries) in enumerate(totals[i]):
            now = layer.positions[0, h]
            torch.testing.assert_close(now[-recent:], entries[-recent:])  # the last `recent` entries stay
            where = {int(p): j for j, p in enumerate(entries)}
            got = total[[where[int(p)] for p in now]]
            torch.testing.assert_close(scores[h].double(), got, rtol=1e-4, atol=1e-5)
            heavy = set(now[:-recent].tolist())
            dropped = [total[j] for j, p in enumerate(entries[:-recent].tolist()) if p not in heavy]
            assert min(got[:-recent]) >= max(dropped) - 1e-5  # the heavy hitters: the top scores (ties allowed)


def test_h2o_adds_the_question_rows_to_its_scores_and_evicts_to_the_budget():
    model, ids, prepared, before, kept, _ = run("h2o")
    check_heavy_recent(prepared, expected_totals(model, ids, before, kept), BUDGET // 2)


def test_tova_keeps_the_top_of_the_questions_last_row():
    model, ids, prepared, before, kept, _ = run("tova")
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


def chunk_gumbel(noise, kept, n_heads) -> dict[int, torch.Tensor]:
    """Per layer `[H_q, Q, N]`: the standard Gumbel noise g = -log(Exp(1)) kvbench draws for the chunk's logits, one
    `[1, H_q, Q, L]` draw per layer (L: the layer's entries, question included), in layer order, from the sample's
    noise stream, each element placed at the position its cache slot holds (query head hq reads KV head
    hq // group; slots: the kept entries in order, then the question)."""
    out = {}
    for i, per_head in enumerate(kept):
        draw = torch.empty(1, n_heads, Q, len(per_head[0]) + Q).exponential_(generator=noise)
        g, full = -draw[0].double().log(), torch.zeros(n_heads, Q, N, dtype=torch.float64)
        for hq in range(n_heads):
            full[hq][:, torch.cat([per_head[hq * len(per_head) // n_heads], torch.arange(N - Q, N)])] = g[hq]
        out[i] = full
    return out


@pytest.mark.parametrize("step, tau", [(0, 1.0), (3, 1.75), (9, 2.0)])
def test_keyformer_adds_the_questions_gumbel_scores_at_the_steps_temperature(step, tau):
    """Keyformer's row score: softmax((x + g) / tau), g fresh standard Gumbel noise per element, summed over the
    question's rows; tau the schedule's after the decode steps so far (Eq. 10, tau_init 1 -> tau_end 2 over
    MAX_NEW = 4 steps: 1 + 3/4 after 3 steps; after 9, more than a turn's T, it stays at tau_end). Then the paper
    rule: the last w = int(0.3 * budget) entries and the top of the others."""
    model, ids, prepared, before, kept, noise = run("keyformer", step=step)
    gumbel = chunk_gumbel(noise, kept, model.config.num_attention_heads)
    probs = {i: ((x + gumbel[i]) / tau).softmax(-1) for i, x in question_logits(model, ids, N - Q, kept).items()}
    check_heavy_recent(prepared, expected_totals(model, ids, before, kept, probs=probs), int(BUDGET * 0.3))


def buzz_rule(kept, scores, n_sink, window, threshold, stride) -> list[int] | None:
    """One head's BUZZ eviction after a chunk, from the spec (kept positions in slot order, their scores): None if the
    middle fits T; else sinks, the old samples (the prefill's middle: every s_hat-th), the first maximum of each
    chunk of s new entries, the window; then the middle halved by s_hat until it fits T (Remark 2, as at prefill)."""
    n, s_hat = len(kept), (stride + 1) // 2
    if n - n_sink - window <= threshold:
        return None
    m_old = len(kept) - Q - n_sink - window  # the prefill evicted: its whole middle became old samples
    middle = list(range(n_sink, n - window))
    old, new = middle[:m_old][::s_hat], middle[m_old:]
    best = [max(new[c:c + stride], key=lambda j: (scores[j], -j)) for c in range(0, len(new), stride)]
    mid = old + best
    while len(mid) > threshold:
        mid = mid[::s_hat]
    return [kept[j] for j in list(range(n_sink)) + mid + list(range(n - window, n))]


@pytest.mark.parametrize("logn", [False, True])
def test_buzz_adds_the_questions_attention_and_keeps_local_maxima(logn):
    """BUZZ's score is accumulated softmax attention (the official `_update_hh_score` adds a multi-row forward's
    column sums to the old scores, the new rows' entries starting from theirs); with log n every row's logits are
    multiplied by log_512 of the keys it attends with (the prompt's n for prefill rows, the layer's entries plus the
    question for the question's rows), the attention too. Then BUZZ's rule over the middle (written above)."""
    model, ids, prepared, before, kept, _ = run("buzz", logn=logn)
    n_sink, stride = BUZZ().n_sink, BUZZ().stride
    window, threshold = BUZZ().sizes(BUDGET)

    def factor(i):  # [N]: each row's log n factor
        out = torch.full((N,), math.log(N - Q) / math.log(512), dtype=torch.float64)
        out[N - Q:] = math.log(len(kept[i][0]) + Q) / math.log(512)
        return out

    logits = question_logits(model, ids, N - Q, kept, factor if logn else None)
    totals = expected_totals(model, ids, before, kept, probs={i: x.softmax(-1) for i, x in logits.items()})
    for i, layer in enumerate(prepared.cache.layers):
        for h, (total, entries) in enumerate(totals[i]):
            expected = buzz_rule(entries.tolist(), total.tolist(), n_sink, window, threshold, stride)
            assert expected is not None  # the question pushes the middle over T: this eviction is tested
            assert layer.positions[0, h].tolist() == expected
            where = {int(p): j for j, p in enumerate(entries)}
            torch.testing.assert_close(prepared.state.scores[i][0, h].double(), total[[where[p] for p in expected]],
                                       rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name, kwargs", [("keyformer", {"logit_adjustment": "none"}),
                                          ("keyformer", {"score": "shared"}), ("buzz", {}),
                                          ("streamingllm_rolling", {})])
def test_other_evictors_score_the_chunk_and_hold_the_budget(name, kwargs):
    _, _, prepared, _, _, _ = run(name, **kwargs)
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
