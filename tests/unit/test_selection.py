"""Kept entries per layer and KV head equal an independent recomputation from the full eager attention matrix."""
from __future__ import annotations

import pytest
import torch

import kvbench.methods  # noqa: F401
from kvbench.cache import KVCache
from kvbench.engine.generation import compress, prefill
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from tests.unit.tiny import prompt, tiny_model

N, LAYERS = 300, 4


def eager_attentions(model, ids):
    """Full n x n attention per layer, [B, H_q, n, n], from transformers' own eager path (the reference)."""
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(ids, output_attentions=True)
    model.set_attn_implementation("sdpa")
    return out.attentions


def expected_scores(attn, window, kernel, n_kv, granularity):
    """SnapKV scores by hand: sum of the window rows over prefix columns, group mean, then a max filter."""
    s = attn[0, :, -window:, : N - window].double().sum(dim=1)  # [H_q, n - w]
    if granularity == "kv_head":
        s = s.view(n_kv, -1, s.shape[-1]).mean(dim=1)
    half = kernel // 2
    return torch.stack([s[:, max(0, i - half): i + half + 1].max(dim=1).values for i in range(s.shape[1])], dim=1)


def kept_positions(method, model, ids, budget):
    cache = KVCache()
    with AttentionCapture(model, window=getattr(method, "window", 0)) as capture:
        prefill(model, ids, cache)
        compress(method, cache, capture, budget)
    return [layer.positions[0] for layer in cache.layers]  # [H, k] original positions per layer


def assert_topk_set(kept_prefix: torch.Tensor, scores: torch.Tensor, k: int):
    """Tie-tolerant: the kept scores are the k largest (as a multiset), and everything strictly above the
    k-th largest score is kept."""
    top = scores.topk(k).values
    assert torch.allclose(scores[kept_prefix].sort(descending=True).values, top, atol=1e-6)
    strictly_above = (scores > top[-1] + 1e-6).nonzero().flatten()
    assert set(strictly_above.tolist()) <= set(kept_prefix.tolist())


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("name,granularity", [("snapkv", "kv_head"), ("snapkv", "query_head"),
                                              ("pyramidkv", "kv_head"), ("pyramidkv", "query_head")])
def test_window_methods_match_eager_recomputation(family, name, granularity):
    model, ids, budget = tiny_model(family, LAYERS), prompt(N), 64
    method = METHODS[name](window=8, granularity=granularity)
    attentions = eager_attentions(model, ids)
    kept = kept_positions(method, model, ids, budget)
    budgets = method.layer_budgets(N, LAYERS, budget)
    n_kv = model.config.num_key_value_heads
    for layer, positions in enumerate(kept):
        scores = expected_scores(attentions[layer], 8, 7, n_kv, granularity)
        assert positions.shape == (scores.shape[0], budgets[layer])
        for head in range(scores.shape[0]):
            window = positions[head][positions[head] >= N - 8]
            assert window.tolist() == list(range(N - 8, N))
            assert_topk_set(positions[head][positions[head] < N - 8], scores[head], budgets[layer] - 8)


def test_pyramid_budgets_in_the_cache_follow_the_hand_worked_schedule():
    # n=300, L=4, B=64, w=8: c=56, k_min=56//20=2, k_max=110, step=(110-2)//3=36 -> 110, 74, 38, 2 (+8 window)
    model, ids = tiny_model("llama", LAYERS), prompt(N)
    kept = kept_positions(METHODS["pyramidkv"](), model, ids, 64)
    assert [p.shape[-1] for p in kept] == [118, 82, 46, 10]


def test_streamingllm_keeps_sinks_and_recent_tokens():
    model, ids = tiny_model("qwen2", LAYERS), prompt(N)
    for positions in kept_positions(METHODS["streamingllm"](n_sink=4), model, ids, 64):
        expected = list(range(4)) + list(range(N - 60, N))
        assert all(row.tolist() == expected for row in positions)
