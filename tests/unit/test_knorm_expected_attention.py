"""Knorm and Expected Attention against independent recomputations on a tiny model.

The reference side never touches kvbench's cache or capture: keys/values come from transformers' own DynamicCache,
pre-RoPE queries from the attention module's q_proj applied to the hidden states it received, and the averaged
RoPE matrix is built as kvpress builds it (cos I + sin P over the model's rotary embedding of the next 512
positions). kvbench's kept original positions after its prefill compression must equal the reference's top-k.
"""
from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

import kvbench.methods  # noqa: F401
from kvbench.cache import KVCache
from kvbench.engine.generation import prefill
from kvbench.models import AttentionCapture
from kvbench.models.rotary import Rotary
from kvbench.models.tiny import tiny_random_model
from kvbench.registry import METHODS
from tests.unit import tiny
from tests.unit.tiny import prompt, tiny_model

N, BUDGET = 90, 24


def kept_by_kvbench(model, ids, method, budget=BUDGET):
    return tiny.kept_by_kvbench(model, ids, method, budget)


def reference_prefill(model, ids):
    """transformers' own cache and each attention module's input hidden states."""
    hidden, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.self_attn.register_forward_pre_hook(
            lambda m, a, kw, i=i: hidden.__setitem__(i, kw["hidden_states"]), with_kwargs=True))
    cache = DynamicCache()
    with torch.no_grad():
        model(ids, past_key_values=cache)
    for h in hooks:
        h.remove()
    return cache, hidden


# --- Knorm ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("recent", [0, 6])
def test_knorm_keeps_the_lowest_key_norms(recent):
    model, ids = tiny_model("llama", layers=2), prompt(N)
    ours = kept_by_kvbench(model, ids, METHODS["knorm"](recent=recent))
    cache, _ = reference_prefill(model, ids)
    for layer, kept in enumerate(ours):
        norms = cache.layers[layer].keys[0].norm(dim=-1)  # [H_kv, N]
        for h in range(norms.shape[0]):
            candidates = norms[h, : N - recent]
            lowest = sorted(candidates.argsort()[: BUDGET - recent].tolist())
            assert kept[h].tolist() == lowest + list(range(N - recent, N))


def test_knorm_refuses_a_window_filling_the_budget():
    with pytest.raises(ValueError, match="knorm: recent=8 must be < budget=8"):
        METHODS["knorm"](recent=8).check_budget(8)


# --- Expected Attention ---------------------------------------------------------------------------------------------
def kvpress_scores(model, ids, layer, window, n_sink=4, n_future=512, vnorm=True, covariance=True):
    """ExpectedAttentionPress.score, written again from kvpress (statistics over the last `window` queries)."""
    cache, hidden = reference_prefill(model, ids)
    attn, cfg = model.model.layers[layer].self_attn, model.config
    h_q, h_kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, attn.head_dim
    w = min(window, N - n_sink)
    with torch.no_grad():
        q = attn.q_proj(hidden[layer][:, N - w:]).view(1, w, h_q, d).transpose(1, 2)  # pre-RoPE
        mu = q.mean(dim=2, keepdim=True)
        cov = torch.einsum("bnsi,bnsj->bnij", q - mu, q - mu) / w
        mu = mu.squeeze(2)
        cos, sin = model.model.rotary_emb(mu, torch.arange(N, N + n_future)[None])
        cos, sin = cos[0], sin[0]
        eye, p = torch.eye(d), torch.zeros(d, d)
        p[d // 2:, : d // 2], p[: d // 2, d // 2:] = torch.eye(d // 2), -torch.eye(d // 2)
        r = (cos.unsqueeze(1) * eye + sin.unsqueeze(1) * p).mean(dim=0)
        mu, cov = mu @ r.T, r @ cov @ r.T
        keys = cache.layers[layer].keys[:, :, n_sink:].repeat_interleave(h_q // h_kv, 1).transpose(2, 3)
        values = cache.layers[layer].values[:, :, n_sink:]
        scores = (mu.unsqueeze(2) @ keys).squeeze(2) / math.sqrt(d)
        if covariance:
            scores = scores + torch.einsum("bhin,bhij,bhjn->bhn", keys, cov, keys) / d / 2
        scores = scores.softmax(dim=-1).view(1, h_kv, h_q // h_kv, -1).mean(dim=2)
        if vnorm:
            scores = scores * values.norm(dim=-1)
    return torch.cat([torch.full((1, h_kv, n_sink), float(scores.max()) + 1), scores], dim=-1), (mu, cov)


def peaked_model(family="llama", layers=2):
    """A tiny model whose attention is far from uniform (random init gives logits near 0, so any scorer would tie
    and the value norms alone would decide): queries and keys scaled up."""
    model = tiny_model(family, layers=layers)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6)
            layer.self_attn.k_proj.weight.mul_(6)
    return model


@pytest.mark.parametrize("kw", [{}, {"use_covariance": False}, {"use_vnorm": False}])
def test_expected_attention_keeps_kvpress_top_entries(kw):
    model, ids = peaked_model(), prompt(N)
    method = METHODS["expected_attention"](window=32, **kw)
    ours = kept_by_kvbench(model, ids, method)
    for layer, kept in enumerate(ours):
        scores, _ = kvpress_scores(model, ids, layer, window=32, vnorm=method.use_vnorm,
                                   covariance=method.use_covariance)
        ref = scores[0].topk(BUDGET, dim=-1).indices.sort(dim=-1).values
        assert torch.equal(kept, ref), (layer, kept, ref)
        assert kept[:, :4].tolist() == [[0, 1, 2, 3]] * kept.shape[0]  # sinks always kept


def test_expected_attention_statistics_equal_kvpress():
    """The statistics from un-rotated post-RoPE window queries equal kvpress's from q_proj(hidden)."""
    model, ids = peaked_model("qwen2", layers=1), prompt(N)
    method = METHODS["expected_attention"](window=40)
    cache = KVCache()
    with AttentionCapture(model, window=40) as capture:
        prefill(model, ids, cache)
        from kvbench.methods.base import LayerView
        view = LayerView(0, 1, cache.layers[0].keys, cache.layers[0].values, capture.window_queries[0],
                         capture.scaling[0], rotary=capture.rotary[0])
        mu, cov = method.query_statistics(view)
    _, (mu_ref, cov_ref) = kvpress_scores(model, ids, 0, window=40)
    torch.testing.assert_close(mu, mu_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cov, cov_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["gptj", "gpt_neox"])
def test_rotary_unrotates_interleaved_and_partial_rotary_queries(family):
    """The capture's rotary angles undo the family's own encoding: un-rotated window queries equal the module's
    query projection of its input (GPT-J: interleaved pairs; GPT-NeoX: partial rotary)."""
    model = tiny_random_model(family, layers=1)
    ids, hidden = prompt(40), {}
    attn = next(m for m in model.modules() if hasattr(m, "layer_idx") and "Attention" in type(m).__name__)
    hook = attn.register_forward_pre_hook(lambda m, a, kw: hidden.__setitem__(0, kw.get("hidden_states", a[0] if a
                                                                                   else None)), with_kwargs=True)
    with AttentionCapture(model, window=10) as capture:
        prefill(model, ids, KVCache())
        pre = capture.rotary[0].unrotate(capture.window_queries[0], torch.arange(30, 40))
        expected = capture.adapter.project_query(attn, hidden[0][:, 30:])
    hook.remove()
    assert capture.rotary[0].theta.numel() > 0
    torch.testing.assert_close(pre, expected.float(), rtol=1e-4, atol=1e-5)


def test_rotary_average_matrix_matches_a_direct_rotation():
    rot = Rotary(torch.tensor([1.0, 0.1]), 1.0, "half")
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])  # 4 rotary dims + 1 untouched
    m = rot.matrix(torch.tensor([3]), 5)[0]
    a = torch.tensor([3.0, 0.3])
    expected = torch.tensor([1 * a[0].cos() - 3 * a[0].sin(), 2 * a[1].cos() - 4 * a[1].sin(),
                             3 * a[0].cos() + 1 * a[0].sin(), 4 * a[1].cos() + 2 * a[1].sin(), 5.0])
    torch.testing.assert_close(m @ x, expected)
    mean = rot.matrix(torch.tensor([3, 7]), 5, mean=True)
    torch.testing.assert_close(mean, rot.matrix(torch.tensor([3, 7]), 5).mean(dim=0))
