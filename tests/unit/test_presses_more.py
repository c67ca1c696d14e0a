"""compactor, cap, finch and snapkv's ThinK switch (kvpress's CompactorPress, CapPress, FinchPress, ThinKPress
composed after SnapKVPress) against independent recomputations on a tiny model and against kvpress 0.5.5's kept
sets on the embedded model (tests/fixtures/kvpress_more/goldens.json, made by scripts/make_kvpress_goldens_more.py). The recomputations follow tests/unit/test_presses.py's rules: keys,
values and eager attention weights from transformers' own prefill, pre-RoPE vectors from the projections, loops
over heads and chunks, and kvbench's kept set a top-`budget` set of the reference's scores (ties either way).
"""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from kvbench.cache.channels import ChannelPrunedLayer
from kvbench.engine.batching import teacher_force
from kvbench.engine.generation import prepare
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from kvbench.runs.config import check_query
from tests.unit.decidable import row_disagreements
from tests.unit.test_presses import N, assert_top, kept_by_kvbench, reference_prefill, rotated_queries, scaled_model
from tests.unit.tiny import prompt

GOLDENS = Path(__file__).resolve().parents[1] / "fixtures/kvpress_more/goldens.json"


@pytest.fixture(scope="module")
def tiny():
    """One scaled tiny Llama (eager: attention weights), its prompt, transformers' cache, hidden states, weights."""
    model, ids = scaled_model(attn="eager"), prompt(N)
    return model, ids, *reference_prefill(model, ids, attentions=True)


def prerope(model, hidden, layer, proj):
    """`[H, N, D]` double: the module's k_proj or q_proj on the hidden states it received (no rotary)."""
    d = model.config.hidden_size // model.config.num_attention_heads
    with torch.no_grad():
        out = getattr(model.model.layers[layer].self_attn, proj)(hidden[layer])[0]
    return out.view(N, -1, d).transpose(0, 1).double()


def zscored(x):
    return (x - x.mean()) / x.std()


# --- compactor ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("blending", [None, 0.7])
def test_compactor_blends_the_z_scored_leverage_and_non_causal_attention_of_the_middle(tiny, blending):
    model, ids, cache, hidden, _ = tiny
    s0, s1, chunk, sketch_dim, budget = 8, 4, 32, 12, 40
    method = METHODS["compactor"](sink_size_start=s0, sink_size_end=s1, chunk_size=chunk,
                                  sketch_dimension=sketch_dim, blending=blending, seed=3)
    ours = kept_by_kvbench(model, ids, method, budget)
    a, b = s0, N - s1
    for layer, kept in enumerate(ours):
        keys = prerope(model, hidden, layer, "k_proj")[:, a:b]
        sketch = torch.randn(1, 2, keys.shape[-1], sketch_dim,
                             generator=torch.Generator().manual_seed(3 + layer))[0].double() / math.sqrt(sketch_dim)
        q, k = rotated_queries(model, hidden, layer).double()[:, a:b], cache.layers[layer].keys[0].double()[:, a:b]
        v = cache.layers[layer].values[0].double()[:, a:b]
        lever, attn = [], []
        for h in range(2):
            x = (keys[h] - keys[h].mean(dim=0)) @ sketch[h]
            gram = x.T @ x + 1e-2 * torch.eye(sketch_dim, dtype=torch.float64)
            lever.append(torch.einsum("ni,ij,nj->n", x, torch.linalg.inv(gram), x).clamp_min(0))
            total = torch.zeros(b - a, dtype=torch.float64)
            for hq in range(3 * h, 3 * h + 3):
                for s in range(0, b - a, chunk):
                    e, pad = min(s + chunk, b - a), max(0, s + chunk - (b - a))
                    logits = q[hq, s:e] @ k[h, s:e].T
                    if pad:  # kvpress's padding: keys at logit -1e-9, padded queries uniform
                        logits = torch.cat([logits, torch.full((e - s, pad), -1e-9, dtype=torch.float64)], dim=1)
                        total[s:e] += pad / chunk
                    total[s:e] += logits.softmax(dim=-1).sum(dim=0)[: e - s]
            attn.append(total / 3 * v[h].norm(dim=-1))
        attn = torch.nn.functional.avg_pool1d(torch.stack(attn)[:, None], 3, stride=1, padding=1)[:, 0]
        weight = 1 - budget / N if blending is None else blending
        middle = weight * zscored(torch.stack(lever)) + zscored(attn)
        scores = torch.cat([torch.full((2, a), math.inf), middle, torch.full((2, s1), math.inf)], dim=1)
        assert_top(kept, scores, budget, rtol=1e-4)


def test_compactor_authors_variant_blends_whole_prompt_chunked_scores_as_their_kernels(tiny):
    """The authors' vLLM reading: chunked leverage with one sketch, raw non-causal sums with their tile padding,
    population z-scores, attention + 0.5 x leverage, ends protected afterwards."""
    model, ids, cache, hidden, _ = tiny
    s0, s1, chunk, lev_chunk, k, budget = 5, 6, 32, 40, 12, 40
    method = METHODS["compactor"](variant="authors", sink_size_start=s0, sink_size_end=s1, chunk_size=chunk,
                                  leverage_chunk=lev_chunk, sketch_dimension=k, blending=0.5, seed=2)
    ours = kept_by_kvbench(model, ids, method, budget)
    pop = lambda x: (x - x.mean()) / x.std(unbiased=False)  # noqa: E731
    for layer, kept in enumerate(ours):
        keys = prerope(model, hidden, layer, "k_proj")
        sketch = torch.randn(1, 2, keys.shape[-1], k, generator=torch.Generator().manual_seed(2 + layer))[0, 0]
        sketch = sketch.double() / math.sqrt(k)
        q, post = rotated_queries(model, hidden, layer).double(), cache.layers[layer].keys[0].double()
        lever, attn = torch.zeros(2, N, dtype=torch.float64), torch.zeros(2, N, dtype=torch.float64)
        for h in range(2):
            for s in range(0, N, lev_chunk):
                x = keys[h, s:s + lev_chunk] @ sketch
                x = x - x.mean(dim=0)
                inverse = torch.linalg.inv(x.T @ x + 5e-3 * torch.eye(k, dtype=torch.float64))
                lever[h, s:s + lev_chunk] = torch.einsum("ni,ij,nj->n", x, inverse, x).clamp_min(0)
            for hq in range(3 * h, 3 * h + 3):
                for s in range(0, N, chunk):
                    rows = min(chunk, N - s)
                    attn[h, s:s + rows] += (q[hq, s:s + rows] @ post[h, s:s + rows].T).softmax(dim=-1).sum(dim=0)
                    attn[h, s:s + rows] += (math.ceil(rows / 64) * 64 - rows) / chunk  # the kernel's empty rows
        scores = pop(attn) + 0.5 * pop(lever)
        scores[:, :s0], scores[:, N - s1:] = math.inf, math.inf
        assert_top(kept, scores, budget, rtol=1e-4)


def test_compactor_refuses_a_budget_inside_its_protected_ends():
    with pytest.raises(ValueError, match="compactor: sink_size_start \\+ sink_size_end = 12 must be < budget=12"):
        METHODS["compactor"]().check_budget(12)
    with pytest.raises(ValueError, match="compactor: blending=-1"):
        METHODS["compactor"](blending=-1)


# --- cap ------------------------------------------------------------------------------------------------------------
def test_cap_scores_the_query_weighted_leverage_of_the_values(tiny):
    model, ids, cache, hidden, _ = tiny
    sink, tau, budget = 4, 5.0, 30
    ours = kept_by_kvbench(model, ids, METHODS["cap"](), budget)
    d = model.config.hidden_size // model.config.num_attention_heads
    with torch.no_grad():  # the average rotation of positions N..N+511, from the model's own rotary embedding
        cos, sin = (t[0].double() for t in model.model.rotary_emb(hidden[0], torch.arange(N, N + 512)[None]))
    half = torch.zeros(d, d, dtype=torch.float64)
    half[d // 2:, : d // 2], half[: d // 2, d // 2:] = torch.eye(d // 2), -torch.eye(d // 2)
    rotation = (cos[:, None] * torch.eye(d) + sin[:, None] * half).mean(dim=0)  # (rows: cos_j I + sin_j R)
    for layer, kept in enumerate(ours):
        queries = prerope(model, hidden, layer, "q_proj")[:, sink:]
        keys, values = (t[0].double()[:, sink:] for t in (cache.layers[layer].keys, cache.layers[layer].values))
        rows = []
        for h in range(2):
            total = torch.zeros(N - sink, dtype=torch.float64)
            for hq in range(3 * h, 3 * h + 3):
                anchor = queries[hq].mean(dim=0) @ rotation.T
                cosine = torch.stack([anchor @ key / (anchor.norm() * key.norm()) for key in keys[h]])
                w = torch.exp(tau * (cosine - cosine.max()))
                capacity = torch.eye(d, dtype=torch.float64) + sum((w[i] + 1e-6) * torch.outer(values[h, i],
                                                                                                values[h, i])
                                                                   for i in range(N - sink))
                inverse = torch.linalg.inv(capacity)
                total += w * torch.stack([vi @ inverse @ vi for vi in values[h]])
            rows.append(total / 3)
        scores = torch.stack(rows)
        assert_top(kept, torch.cat([torch.full((2, sink), float(scores.max()) + 1), scores], dim=1), budget, 1e-4)
        assert all(set(range(sink)) <= set(row.tolist()) for row in kept)


# --- finch ----------------------------------------------------------------------------------------------------------
def finch_reference(attentions, layer, w, normalize=True):
    """kvpress FinchPress's scores `[2, N]` from eager weights: window rows x their position, mean, group mean."""
    rows = attentions[layer][0, :, N - w:, : N - w].double()  # [H_q, w, N - w]
    if normalize:
        rows = rows * torch.arange(N - w, N, dtype=torch.float64)[:, None]
    per_kv = rows.mean(dim=1).view(2, 3, -1).mean(dim=1)
    return torch.cat([per_kv, torch.full((2, w), float(per_kv.max()) + 1, dtype=torch.float64)], dim=-1)


@pytest.mark.parametrize("normalize", [True, False])
def test_finch_scores_the_question_s_normalised_attention_to_the_context(tiny, normalize):
    """The question (the prompt's last 11 tokens, as the runner hands it under query=aware) is the window."""
    model, ids, _, _, attentions = tiny
    method, question, budget = METHODS["finch"](normalize_scores=normalize), 11, 30
    capture = AttentionCapture(model)
    with capture:
        run = prepare(model, method, capture, ids, budget, 1, question_len=question, compress_after="prefill")
    for layer, kept in enumerate(run.cache.layers):
        assert_top(kept.positions[0], finch_reference(attentions, layer, question, normalize), budget)
    assert run.cache.layers[0].keys.shape[-2] == budget and run.logits.shape[-2:] == (1, 256)


def test_finch_in_chunks_keeps_each_chunk_s_share(tiny):
    model, ids, _, _, attentions = tiny
    w, c, budget = 4, 25, 30  # chunks 25, 25, 25, 15 keep 9, 8, 8, 5 (shares 8.33, 8.33, 8.33, 5: the first
    #                            of the equal remainders gets the one entry left)
    ours = kept_by_kvbench(model, ids, METHODS["finch"](window=w, chunk_length=c), budget)
    for layer, kept in enumerate(ours):
        scores = finch_reference(attentions, layer, w)
        for start, k in zip(range(0, N, c), [9, 8, 8, 5]):
            part = kept[(kept >= start) & (kept < start + c)].view(2, -1) - start
            assert part.shape[1] == k
            assert_top(part, scores[:, start:start + c], k)


def test_finch_needs_its_question():
    finch = METHODS["finch"]()
    with pytest.raises(ValueError, match="query=agnostic: finch's window is the question"):
        check_query(OmegaConf.create({"query": "agnostic", "generation": {}}), finch)
    check_query(OmegaConf.create({"query": "agnostic", "generation": {}}), METHODS["finch"](window=8))
    view = type("View", (), {"question_len": 0, "window_queries": None, "prompt_len": 50})()
    with pytest.raises(ValueError, match="finch: no question to score with"):
        finch.window_size(view)


# --- snapkv key_channels (ThinK) --------------------------------------------------------------------------------
def test_think_keeps_the_channels_with_the_highest_query_and_key_energy_and_stores_only_them(tiny):
    model, ids, cache, hidden, _ = tiny
    w, budget = 10, 30
    method = METHODS["snapkv"](window=8, key_channels=0.5, channel_window=w)
    selected = kept_by_kvbench(model, ids, METHODS["snapkv"](window=8), budget)  # ThinK leaves the selection alone
    capture = AttentionCapture(model)
    with capture:
        run = prepare(model, method, capture, ids, budget, 1, compress_after="prefill")
    for layer, stored in enumerate(run.cache.layers):
        assert isinstance(stored, ChannelPrunedLayer) and torch.equal(stored.positions[0], selected[layer])
        q = rotated_queries(model, hidden, layer).double()[:, N - w:]  # [H_q, w, D]
        held = stored.full_prompt_keys()[0].double()
        for h in range(2):
            kept_keys = cache.layers[layer].keys[0, h].double()[selected[layer][h]]  # [budget, D]
            q_energy = sum(q[hq].pow(2).mean(dim=0) for hq in range(3 * h, 3 * h + 3)) / 3
            score = q_energy * kept_keys.pow(2).mean(dim=0)
            expected = sorted(score.argsort(descending=True)[:8].tolist())  # D = 16: 8 pruned, 8 kept
            assert stored.channels[0, h].tolist() == expected
            dropped = [c for c in range(16) if c not in expected]
            assert torch.allclose(held[h][:, expected], kept_keys[:, expected]) and not held[h][:, dropped].any()
    # K at D' = 8 channels, V at D = 16, fp32, 2 heads x 30 entries, and the int16 channel index
    assert run.cache.layers[0].nbytes() == 2 * budget * 8 * 4 + 2 * budget * 16 * 4 + 2 * 8 * 2


def test_think_decodes_as_kvpress_s_zeroed_channels():
    """The stored channels, put back at their places, attend as kvpress's dense keys with the pruned channels zeroed:
    the same logits at every teacher-forced step (the generated tokens' keys keep every channel in both)."""
    model, ids, tokens = scaled_model(), prompt(N), [5, 17, 33, 71]
    logits = {}
    for channels in (0.5, 0.0):
        capture = AttentionCapture(model)
        with capture:
            run = prepare(model, METHODS["snapkv"](window=8, key_channels=channels), capture, ids, 30, 5)
            if not channels:  # kvpress's way: the same entries, dense, the pruned channels zeroed
                for dense, pruned in zip(run.cache.layers, pruned_layers):
                    mask = torch.zeros(dense.keys.shape[-1], dtype=torch.bool)
                    for h in range(2):
                        mask[:] = True
                        mask[pruned.channels[0, h].long()] = False
                        dense.keys[0, h][:, mask] = 0
            else:
                pruned_layers = list(run.cache.layers)
            seen = []
            teacher_force(model, capture, run, tokens, lambda t, x: seen.append(x.clone()))
        logits[channels] = torch.stack(seen)
    assert torch.allclose(logits[0.5], logits[0.0], atol=1e-5, rtol=1e-5)


def test_think_is_refused_where_its_layers_cannot_go():
    from kvbench.engine.recompress import DecodeCompression, check
    from kvbench.engine.static import unsupported

    method = METHODS["snapkv"](key_channels=0.25)
    assert "key channels" in unsupported(method)
    with pytest.raises(ValueError, match="prunes key channels"):
        check(method, DecodeCompression(target=64))
    with pytest.raises(ValueError, match="key_channels=1.0 must be in"):
        METHODS["snapkv"](key_channels=1.0)


# --- kvpress's own kept sets on the embedded model ------------------------------------------------------------------
@pytest.mark.parametrize("case", ["compactor", "cap", "finch", "finch_chunked", "think"])
def test_kept_sets_equal_kvpress_on_the_embedded_model(case, embedded_views):
    prompts, views = embedded_views  # (tests/conftest.py) the prompts of kvpress_new/goldens.json, which ours reuse
    goldens = json.loads(GOLDENS.read_text())
    golden = goldens["cases"][case]
    method = METHODS[golden["method"]](**golden["fields"])
    for p, (prompt_golden, layers) in enumerate(zip(prompts["prompts"], views)):
        budget = prompt_golden["budget"]
        for view, heads in zip(layers, golden["kept"][p]):
            kept = method.select(replace(view, question_len=goldens["question_tokens"]), budget)
            for h, mask in enumerate(heads):
                theirs = {i for i in range(view.prompt_len) if int(mask, 16) >> i & 1}  # ties: decidable.py
                assert not row_disagreements(method, replace(view, question_len=goldens["question_tokens"]), h,
                                             set(kept[0, h].tolist()), theirs, f"{case} {p} {view.layer_idx} {h}")
            if method.prunes_channels:  # ThinK: the channels each head keeps, from the keys the selection kept
                keys = view.keys.gather(2, kept[..., None].expand(-1, -1, -1, view.keys.shape[-1]))
                channels = method.channels_to_keep(view, keys)[0]
                for h, mask in enumerate(golden["channels"][p][view.layer_idx]):
                    assert channels[h].tolist() == [c for c in range(keys.shape[-1]) if int(mask, 16) >> c & 1]
