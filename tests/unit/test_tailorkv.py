"""TailorKV's offloaded retrieval and byte ledger, checked against independent recomputations (spec §2.2)."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

import kvbench.methods  # noqa: F401
from kvbench.attention.decode import attend
from kvbench.cache import KVCache
from kvbench.cache.kv_cache import KVLayer
from kvbench.cache.ledger import TransferLedger
from kvbench.cache.offloaded import OffloadedLayer
from kvbench.cache.quantized import QuantizedLayer
from kvbench.engine.generation import compress, prefill
from kvbench.engine.batching import generate
from kvbench.methods.tailorkv import TailorKV
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from tests.unit.tiny import attention_function, prompt, tiny_model

N, NEW = 200, 8
H_Q, H_KV, D = 6, 2, 16  # the tiny models' heads


def filled_layer(n: int, seed: int = 0) -> KVLayer:
    g = torch.Generator().manual_seed(seed)
    layer = KVLayer()
    layer.update(torch.randn(1, H_KV, n, D, generator=g), torch.randn(1, H_KV, n, D, generator=g))
    return layer


def offloaded(n=N, start=4, recent=12, topk=32, channels=4, seed=0):
    layer = OffloadedLayer.from_layer(filled_layer(n, seed), start, recent, topk, channels, TransferLedger())
    layer.selections = []
    return layer


def reference_selection(query, keys, start, recent, topk, channels):
    """Spec §1.3 written out head by head in float64: channel score |mean_g q| * max_t |K|, top channels, partial
    dot products over them, top-k of positions [start, n - recent)."""
    n, group = keys.shape[2], H_Q // H_KV
    chosen, picked = [], []
    for h in range(H_KV):
        q_mean = query[0, h * group:(h + 1) * group, 0].double().mean(0)
        k = keys[0, h].double()
        c = torch.topk(q_mean.abs() * k.abs().max(0).values, channels).indices
        scores = k[:, c] @ q_mean[c]
        chosen.append(set(c.tolist()))
        picked.append(set((torch.topk(scores[start:n - recent], topk).indices + start).tolist()))
    return chosen, picked


@pytest.mark.parametrize("channels", [D, 5])
def test_selection_equals_independent_recompute(channels):
    layer = offloaded(channels=channels)
    keys = layer.host_keys.clone()
    query = torch.randn(1, H_Q, 1, D, generator=torch.Generator().manual_seed(3))
    layer.update(torch.randn(1, H_KV, 1, D), torch.randn(1, H_KV, 1, D))
    attend(layer, query, 0.25)
    (got_channels, got_top), = layer.selections
    chosen, picked = reference_selection(query, keys, 4, 12, 32, channels)
    for h in range(H_KV):  # one selection per KV head, shared by its query heads
        assert set(got_channels[0, h].tolist()) == chosen[h]
        assert set(got_top[0, h].tolist()) == picked[h]


def test_sinks_recent_and_generated_are_never_candidates_but_always_attended():
    query = torch.randn(1, H_Q, 1, D, generator=torch.Generator().manual_seed(5))
    prompt_layer = filled_layer(N)
    boost = query[0].reshape(H_KV, -1, D).mean(1)[None] * 50  # keys aligned with the query would score highest
    for t in (*range(4), *range(N - 12, N)):
        prompt_layer.keys[:, :, t] += boost
    layer = OffloadedLayer.from_layer(prompt_layer, 4, 12, 8, 4, TransferLedger())
    layer.selections = []
    g = torch.Generator().manual_seed(6)  # seeded: the global RNG's state depends on which tests ran before
    new_k, new_v = torch.randn(1, H_KV, 1, D, generator=g), torch.randn(1, H_KV, 1, D, generator=g)
    layer.update(new_k, new_v)
    out = attend(layer, query, 0.25)
    (_, top), = layer.selections
    assert top.min() >= 4 and top.max() < N - 12
    for h in range(H_KV):  # exact attention over sinks + recent + the top-k + the generated token
        idx = torch.cat([torch.arange(4), top[0, h], torch.arange(N - 12, N)])
        k = torch.cat([layer.host_keys[0, h, idx], new_k[0, h]]).double()
        v = torch.cat([layer.host_values[0, h, idx], new_v[0, h]]).double()
        q = query[0, h * 3:(h + 1) * 3, 0].double()
        expected = torch.softmax(q @ k.T * 0.25, -1) @ v
        # the boosted keys give logits of ~1e2, so fp32 softmax carries ~1e-5 (a wrong entry would be off by ~1)
        torch.testing.assert_close(out[0, 0, h * 3:(h + 1) * 3].double(), expected, rtol=1e-4, atol=1e-4)


def test_offload_keeps_only_sinks_recent_and_generated_on_the_device():
    layer = offloaded(start=4, recent=12)
    fp32 = 4
    assert layer.nbytes() == 2 * H_KV * 16 * D * fp32 + H_KV * D * fp32  # K/V of 16 entries + max|K|
    assert layer.host_nbytes() == 3 * H_KV * N * D * fp32  # K, V and the transposed K copy
    layer.update(torch.randn(1, H_KV, 1, D), torch.randn(1, H_KV, 1, D))
    assert layer.nbytes() == 2 * H_KV * 17 * D * fp32 + H_KV * D * fp32


def run(model, ids, budget, eos=frozenset(), **kwargs):
    method = TailorKV(**kwargs) if budget is not None else METHODS["full"]()
    seen = []
    with AttentionCapture(model) as capture:
        gen = generate(model, None, method, capture, ids, budget, NEW, eos_ids=set(eos),
                       on_logits=lambda t, logits: seen.append(logits.clone()))
    return gen, seen


def test_budget_covering_the_prompt_equals_full_cache():
    """top-k >= candidates and d_s = D, no quantized layer: every prompt token is fetched each step (exact)."""
    model, ids = tiny_model("llama"), prompt(N)
    full, full_logits = run(model, ids, None)
    gen, logits = run(model, ids, N, quant_layers=[], start_size=4, recent_size=12, channels=D)
    assert gen.token_ids == full.token_ids
    for a, b in zip(logits, full_logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert gen.transfers["h2d_bytes_per_step"]["topk_keys"][0] == 4 * H_KV * (N - 16) * D * 4  # all candidates


def test_quantized_layers_stay_close_and_the_first_token_is_exact():
    model, ids = tiny_model("llama"), prompt(N)
    _, full_logits = run(model, ids, None)
    for bits, tol in ((8, 2e-2), (2, None)):
        _, logits = run(model, ids, N, quant_layers=[0, 1], bits=bits, residual=64, start_size=4,
                          recent_size=12, channels=D)
        assert torch.equal(logits[0], full_logits[0])  # prefill is exact
        if tol is not None:
            torch.testing.assert_close(logits[1], full_logits[1], rtol=tol, atol=tol)
        assert not torch.equal(logits[1], full_logits[1])  # decoding really reads the quantized layers


def test_ledger_counts_equal_closed_form_bytes():
    """Spec §1.3: per sparse layer and step, critical keys H·d_s·n and top-k K and V H·k·D elements each; the
    prefill offload is K, V and Kᵀ of every sparse layer. fp32 here (4 bytes)."""
    model, ids = tiny_model("llama"), prompt(N)
    gen, _ = run(model, ids, 48, quant_layers=[0], start_size=4, recent_size=12, channels=5)
    steps = len(gen.token_ids) - 1  # decode forwards
    sparse = 3
    ledger = gen.transfers
    assert ledger["h2d_bytes_per_step"]["critical_keys"] == [sparse * H_KV * 5 * N * 4] * steps
    assert ledger["h2d_bytes_per_step"]["topk_keys"] == [sparse * H_KV * 32 * D * 4] * steps
    assert ledger["h2d_bytes_per_step"]["topk_values"] == [sparse * H_KV * 32 * D * 4] * steps
    assert ledger["h2d_bytes_per_token"] == sparse * H_KV * 4 * (5 * N + 2 * 32 * D)
    assert ledger["d2h_prefill_bytes"] == sparse * 3 * H_KV * N * D * 4
    # most fetched bytes alive at once: this layer's channel slices and rows + the next layer's prefetched slices
    assert ledger["transient_device_bytes_max"] == H_KV * 4 * (2 * 5 * N + 2 * 32 * D)
    assert gen.host_kv_bytes == sparse * 3 * H_KV * N * D * 4
    device = sparse * (2 * H_KV * 16 * D * 4 + H_KV * D * 4)  # sinks + recent, max|K|
    assert sum(gen.kv_bytes_per_layer[1:]) == device
    per_token = 2 * H_KV * D * 4  # each generated token stays on the device in every sparse layer
    assert sum(gen.kv_bytes_per_layer_final[1:]) == device + sparse * steps * per_token
    resident = ledger["device_bytes_per_step"]
    assert resident[0] == gen.kv_bytes and len(resident) == steps
    assert all(b - a >= sparse * per_token for a, b in zip(resident, resident[1:]))  # grows by a token each step
    # the 1-bit layer (residual 128): keys 128 quantized + 72 fp32, values 72 quantized + 128 fp32
    key_bytes = 128 * H_KV * D // 8 + H_KV * D * (128 // 64) * 2 * 2 + 72 * H_KV * D * 4
    value_bytes = 72 * H_KV * D // 8 + 72 * H_KV * 1 * 2 * 2 + 128 * H_KV * D * 4  # one group of D=16 per token
    assert gen.kv_bytes_per_layer[0] == key_bytes + value_bytes


def test_predicted_query_is_the_next_layers_projection_of_this_input():
    """q̂_{l+1} = RoPE(W_q^{l+1} h_l): feeding h_l to layer l+1's attention module gives the same query."""
    model, ids = tiny_model("llama"), prompt(40)
    with AttentionCapture(model) as capture:
        seen = {}
        capture.input_hook = lambda i, hidden, pos: seen.setdefault(i, (hidden, pos))
        cache = DynamicCache()
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
            model(ids[:, :1], past_key_values=cache, position_ids=torch.tensor([[40]]), use_cache=True)
        hidden, pos = seen[1]
        predicted = capture.predict_query(2, hidden, pos)
    attn = model.model.layers[2].self_attn
    grabbed = {}

    def grab(module, q, k, v, mask, **kw):
        grabbed["q"] = q
        return torch.zeros(q.shape[0], q.shape[2], q.shape[1], q.shape[3]), None

    with attention_function(model, grab):
        attn(hidden_states=hidden, position_embeddings=pos, attention_mask=None)
    torch.testing.assert_close(predicted, grabbed["q"])


def test_decode_logits_equal_masked_full_attention_over_the_selection():
    """One decode step through the model equals full attention over the uncompressed cache masked, per KV group,
    to sinks + recent + the selected tokens + the new token (independent of the offloaded layer's attention)."""
    model, ids = tiny_model("llama"), prompt(N)
    method = TailorKV(quant_layers=[], start_size=4, recent_size=12, channels=5)
    cache = KVCache()
    with AttentionCapture(model) as capture:
        logits = prefill(model, ids, cache)
        compress(method, cache, capture, 40)
        for layer in cache.layers:
            layer.selections = []
        token = logits.argmax(-1, keepdim=True)
        with torch.no_grad():
            ours = model(token, past_key_values=cache, position_ids=torch.tensor([[N]])).logits[:, -1]
        chosen = [layer.selections[0][1][0] for layer in cache.layers]  # [H_kv, k] per layer

    def masked(module, q, k, v, mask, scaling=None, **kw):
        allowed = torch.zeros(H_Q, k.shape[2], dtype=torch.bool)
        for hq in range(H_Q):
            allowed[hq, chosen[module.layer_idx][hq // 3]] = True
        allowed[:, :4] = allowed[:, N - 12:] = True  # sinks, recent and the new token
        k, v = k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[None, :, None, :], scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    with torch.no_grad():
        reference = DynamicCache()
        model(ids, past_key_values=reference, use_cache=True)
    with attention_function(model, masked):
        expected = model(token, past_key_values=reference, position_ids=torch.tensor([[N]])).logits[:, -1]
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


def test_layers_become_quantized_and_offloaded_stores():
    model, ids = tiny_model("llama"), prompt(N)
    cache = KVCache()
    with AttentionCapture(model) as capture:
        prefill(model, ids, cache)
        compress(TailorKV(quant_layers=[0], start_size=4, recent_size=12), cache, capture, 48)
    assert isinstance(cache.layers[0], QuantizedLayer)
    assert all(isinstance(layer, OffloadedLayer) for layer in cache.layers[1:])


@pytest.mark.parametrize("rest,kinds", [
    ("full", [QuantizedLayer, KVLayer, KVLayer, KVLayer]),  # Table 1's rows: only layer 0 at 1 bit, the rest whole
    ("quantized", [QuantizedLayer] * 4),  # Table 1's KIVI row: every layer at 1 bit
])
def test_rest_keeps_or_quantizes_the_other_layers(rest, kinds):
    model, ids = tiny_model("llama"), prompt(N)
    cache = KVCache()
    with AttentionCapture(model) as capture:
        prefill(model, ids, cache)
        full_bytes = [layer.nbytes() for layer in cache.layers]
        ledger = compress(TailorKV(quant_layers=[0], rest=rest, residual=32, group_size=32), cache, capture, 192)
    assert [type(layer) for layer in cache.layers] == kinds
    for layer, before in zip(cache.layers, full_bytes):  # a layer kept whole keeps its bytes; a quantized one shrinks
        assert (layer.nbytes() == before) if type(layer) is KVLayer else layer.nbytes() < before
    assert ledger.summary()["d2h_prefill_bytes"] == 0  # nothing offloaded to the host


@pytest.mark.parametrize("kwargs,budget,message", [
    ({"rest": "dense"}, 192, "rest='dense' is not one of offload, full, quantized"),
    ({"bits": 3}, 192, "bits=3 is not one of 1, 2, 4, 8"),
    ({"channel_query": "next"}, 192, "channel_query='next' is not one of predicted, current"),
    ({"quant_layers": "0"}, 192, "quant_layers='0' must be a list of layer indices"),
    ({}, 64, "budget=64 must exceed start_size + recent_size = 64"),
])
def test_bad_settings_fail_in_one_line(kwargs, budget, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        TailorKV(**kwargs).check_budget(budget)


def test_quant_layers_outside_the_model_fail_clearly():
    model, ids = tiny_model("llama"), prompt(40)
    cache = KVCache()
    with AttentionCapture(model) as capture:
        prefill(model, ids, cache)
        with pytest.raises(ValueError, match=r"quant_layers \[7\] outside the model's layers 0..3"):
            compress(TailorKV(quant_layers=[7]), cache, capture, 192)


def test_prepare_identifies_the_split_when_the_model_config_has_none():
    from kvbench.methods.tailorkv_layers import identify_with_calibration

    model = tiny_model("llama", layers=2)
    tokenizer = lambda text, return_tensors: type("Enc", (), {"input_ids": prompt(300)})()  # noqa: E731
    method = TailorKV()
    prepared = method.prepare(model, tokenizer, prefill=prefill)
    expected = identify_with_calibration(model, tokenizer, prefill=prefill)
    assert prepared["quant_layers"] == method.quant_layers == expected.quant_layers
    assert prepared["identification"]["scores"] == [round(x, 6) for x in expected.scores]
    assert TailorKV(quant_layers=[1]).prepare(model, tokenizer) == {"quant_layers": [1], "identification": None}
    # the engine's prefill comes from the caller (methods sit below the engine); without it, a one-line error
    with pytest.raises(ValueError, match=r"tailorkv: identifying quant_layers runs a prefill; .*prefill="):
        TailorKV().prepare(model, tokenizer)
