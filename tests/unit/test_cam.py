"""CaM (kvbench/methods/cam.py) against an independent step-by-step recomputation.

The reference decodes greedily with the plain transformers model (eager attention, `output_attentions`) over a
`DynamicCache` it edits by hand between steps, as the authors' `local_cam_mask` does: the prompt is cut to start +
recent once; after each step every layer drops its oldest recent entry and merges the next oldest into the
following `merge_budget` entries with probability min(1, A_i / mean A_{i+1..}) (A: the step's attention, mean over
each KV group), drawing one Bernoulli per KV head, layer by layer, from a generator seeded as kvbench's. kvbench's
tokens, kept positions and merged values must be the reference's."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvbench.methods  # noqa: F401
from kvbench.engine.batching import decode
from kvbench.engine.generation import prepare
from kvbench.engine.static import unsupported
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from tests.unit.test_kvzip import peaked_model
from tests.unit.tiny import prompt, tiny_model

N, BUDGET, STEPS = 40, 12, 6


def reference(model, ids, start, merge_budget, seed=0):
    eager = tiny_model("llama", layers=2, attn="eager")
    eager.load_state_dict(model.state_dict())
    g = eager.config.num_attention_heads // eager.config.num_key_value_heads
    recent = BUDGET - start
    generator = torch.Generator().manual_seed(seed)
    cache, tokens = DynamicCache(), []
    with torch.no_grad():
        out = eager(ids, past_key_values=cache)
        for layer in cache.layers:  # the prompt cut once, no merge
            keep = list(range(start)) + list(range(N - recent, N))
            layer.keys, layer.values = layer.keys[:, :, keep], layer.values[:, :, keep]
        for t in range(STEPS):
            tokens.append(int(out.logits[0, -1].argmax()))
            if t == STEPS - 1:  # the last token is generated, never fed
                break
            out = eager(torch.tensor([[tokens[-1]]]), past_key_values=cache, position_ids=torch.tensor([[N + t]]),
                        output_attentions=True)
            for layer, probs in zip(cache.layers, out.attentions):
                a = probs[0, :, -1].view(-1, g, probs.shape[-1]).mean(1)  # [H_kv, BUDGET + 1]
                i = start + 1
                p = (a[:, i] / a[:, i + 1:].mean(-1)).nan_to_num(0.0, posinf=1.0).clamp(0, 1)
                merged = torch.bernoulli(p[None], generator=generator)[0]
                values = layer.values.clone()
                for h in range(a.shape[0]):
                    values[0, h, i + 1:i + 1 + merge_budget] += values[0, h, i] * merged[h] / merge_budget
                keep = list(range(start)) + list(range(BUDGET + 1 - recent, BUDGET + 1))
                layer.keys, layer.values = layer.keys[:, :, keep], values[:, :, keep]
    return tokens, cache


@pytest.mark.parametrize("n_sink,merge_budget", [(None, 32), (2, 3)])
def test_decoding_equals_the_step_by_step_reference(n_sink, merge_budget):
    model, ids = peaked_model(), prompt(N)
    method = METHODS["cam"](n_sink=n_sink, merge_budget=merge_budget)
    start = BUDGET // 2 if n_sink is None else n_sink
    with AttentionCapture(model) as capture:
        prepared = prepare(model, method, capture, ids, BUDGET, STEPS)
        gen = decode(model, None, method, capture, prepared, STEPS, eos_ids=set())
    tokens, ref = reference(model, ids, start, merge_budget)
    assert gen.token_ids[:STEPS] == tokens
    recent = BUDGET - start
    positions = list(range(start)) + list(range(N + STEPS - 1 - recent, N + STEPS - 1))
    for layer, ref_layer in zip(prepared.cache.layers, ref.layers):
        assert layer.positions[0, 0].tolist() == positions
        torch.testing.assert_close(layer.values, ref_layer.values, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(layer.keys, ref_layer.keys, rtol=1e-5, atol=1e-6)


def test_merging_changes_values_and_the_static_step_refuses_it():
    model, ids = peaked_model(), prompt(N)
    kept = {}
    for name, method in (("cam", METHODS["cam"](n_sink=6)), ("window", METHODS["streamingllm_rolling"](n_sink=6))):
        with AttentionCapture(model) as capture:
            prepared = prepare(model, method, capture, ids, BUDGET, STEPS)
            decode(model, None, method, capture, prepared, STEPS, eos_ids=set())
        kept[name] = prepared.cache.layers
    for cam_layer, window_layer in zip(kept["cam"], kept["window"]):
        assert torch.equal(cam_layer.positions, window_layer.positions)
    assert any(not torch.equal(a.values, b.values) for a, b in zip(kept["cam"], kept["window"]))
    assert "merges" in unsupported(METHODS["cam"]())
    with pytest.raises(ValueError, match="at least 2 recent entries"):
        METHODS["cam"](n_sink=11).check_budget(12)
    with pytest.raises(ValueError, match="merge_budget"):
        METHODS["cam"](merge_budget=0)
