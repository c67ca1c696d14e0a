"""Learned attention sinks (gpt-oss) and MLA latent caches (DeepSeek-V3): kvbench's own attention math against the
models' own kernels, the full cache against transformers' `generate`, hand-worked bytes, and the one-line refusals.
(Every method's decode step against a masked recomputation through the model's own kernel: tests/unit/test_families.py,
families gpt_oss and deepseek_v3.)"""
from __future__ import annotations

import importlib

import pytest
import torch

import kvbench.methods  # noqa: F401
from kvbench.attention.columns import causal_column_sums
from kvbench.attention.decode import chunk_attention, decode_attention
from kvbench.attention.sinks import sink_softmax
from kvbench.cache.kv_cache import DecodeKV, KVLayer
from kvbench.engine.batching import generate
from kvbench.methods.base import window_attention
from kvbench.methods.latent import check_latent, latent_refusal
from kvbench.models import AttentionCapture
from kvbench.models.mla import absorb_query, latent_keys
from kvbench.models.tiny import tiny_random_model
from kvbench.registry import METHODS
from tests.unit.test_families import configured
from tests.unit.tiny import prompt

torch.set_num_threads(1)
N = 120


@pytest.fixture(scope="module")
def gpt_oss():
    return tiny_random_model("gpt_oss", layers=3)


@pytest.fixture(scope="module")
def deepseek():
    return tiny_random_model("deepseek_v3", layers=3)


def gpt_oss_eager(module, q, k, v, mask):
    """transformers' own gpt-oss kernel: (output `[B, q, H, D]`, probabilities `[B, H, q, k]`)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    return eager_attention_forward(module, q, k, v, mask, scaling=module.scaling)


# --- sinks: kvbench's math equals the model's kernel --------------------------------------------------------------
def test_sink_softmax_is_the_kernels_softmax_with_the_sink_column_dropped():
    logits = torch.randn(2, 4, 3, 7)
    logits[0, 1, 2] = float("-inf")  # a row whose keys are all masked: all zero, as the kernel gives
    sinks = torch.randn(4)
    column = sinks.view(1, 4, 1, 1).expand(2, 4, 3, 1)
    expected = torch.cat([logits, column], -1).softmax(-1)[..., :-1]
    torch.testing.assert_close(sink_softmax(logits, sinks.view(1, 4, 1, 1)), expected)
    assert float(sink_softmax(logits, sinks.view(1, 4, 1, 1))[0, 1, 2].abs().sum()) == 0.0


def test_decode_and_chunk_attention_with_sinks_equal_gpt_oss_kernel(gpt_oss):
    """One token over a layer with padded heads (Ada-KV's form), and a chunk of 3 on top of 9 entries: kvbench's
    decode/chunk attention with the layer's sinks equals gpt-oss's eager kernel with the same keys masked."""
    module = gpt_oss.model.layers[1].self_attn
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)
    valid = torch.ones(1, 2, 9, dtype=torch.bool)
    valid[0, 1, 2:5] = False  # head 1 holds fewer entries
    out, _ = decode_attention(q, [DecodeKV(k, v, valid)], module.scaling, sinks=module.sinks.detach())
    mask = torch.zeros(1, 4, 1, 9).masked_fill(~valid.repeat_interleave(2, 1)[:, :, None], float("-inf"))
    with torch.no_grad():
        expected = gpt_oss_eager(module, q, k, v, mask)[0]
    torch.testing.assert_close(out, expected)

    chunk = torch.randn(1, 4, 3, 16)
    causal = torch.zeros(3, 9).masked_fill(torch.ones(3, 9, dtype=torch.bool).triu(7), float("-inf"))
    with torch.no_grad():
        torch.testing.assert_close(chunk_attention(chunk, DecodeKV(k, v), module.scaling, sinks=module.sinks),
                                   gpt_oss_eager(module, chunk, k, v, causal[None, None])[0])


def test_window_scores_and_column_sums_include_the_sink(gpt_oss):
    """SnapKV's window attention and H2O's column sums are gpt-oss's own attention probabilities (sink in the
    denominator), not a plain softmax over the keys."""
    module = gpt_oss.model.layers[1].self_attn
    torch.manual_seed(1)
    n, w = 12, 4
    q, k = torch.randn(1, 4, n, 16), torch.randn(1, 2, n, 16)
    causal = torch.zeros(n, n).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    with torch.no_grad():
        probs = gpt_oss_eager(module, q, k, torch.randn(1, 2, n, 16), causal[None, None])[1]  # [1, 4, n, n]
        sinks = module.sinks.detach()
    torch.testing.assert_close(window_attention(q[:, :, -w:], k, module.scaling, sinks=sinks), probs[:, :, -w:])
    sums = causal_column_sums(q, k, module.scaling, {"h2o": lambda x: x.softmax(-1)}, sinks=sinks)["h2o"]
    torch.testing.assert_close(sums, probs.sum(dim=2))
    assert not torch.allclose(window_attention(q[:, :, -w:], k, module.scaling), probs[:, :, -w:])  # it matters


# --- MLA: absorbed scores are the model's logits ------------------------------------------------------------------
def test_absorbed_queries_against_the_latent_give_the_models_own_logits(deepseek):
    """q~ . [c, k_rope] equals q . k with k expanded per head by the module itself (`expand_kv`), for every head,
    with a latent (32) wider than the per-head key (16): one latent head scores every query head exactly."""
    module = deepseek.model.layers[1].self_attn
    torch.manual_seed(2)
    latent, rope = torch.randn(1, 1, 10, 32), torch.randn(1, 1, 10, 8)
    query = torch.randn(1, 4, 3, 16)
    with torch.no_grad():
        keys, _ = module.expand_kv(latent, rope)  # [1, 4, 10, 16]
        expected = query @ keys.transpose(-1, -2)
        got = absorb_query(module, query) @ latent_keys(latent, rope).transpose(-1, -2)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# --- whole models: the full cache is transformers' generate; bytes by hand ----------------------------------------
@pytest.mark.parametrize("family", ["gpt_oss", "deepseek"])
def test_full_cache_generates_transformers_greedy_tokens(family, request):
    model, ids = request.getfixturevalue(family), prompt(40)
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, 40:].tolist()
    with AttentionCapture(model) as capture:
        got = generate(model, None, configured("full"), capture, ids, None, 8, eos_ids=set())
    assert got.token_ids == expected


def test_kv_bytes_of_a_latent_cache_by_hand(deepseek):
    """DeepSeek-V3 tiny: 3 MLA layers, each entry one latent (32) + one rotary key (8) for all 4 heads, fp32.
    SnapKV at budget 32 of a 120-token prompt keeps 32 entries per layer: 3 x 32 x (32 + 8) x 4 = 15360 bytes
    (per-head K/V would be 3 x 32 x 4 heads x (16 + 16) x 4 = 49152); the full cache 3 x 120 x 160 = 57600."""
    ids = prompt(N)
    with AttentionCapture(deepseek, window=8) as capture:
        snap = generate(deepseek, None, configured("snapkv"), capture, ids, 32, 1, eos_ids=set())
    assert snap.kv_bytes == 15360 and snap.full_kv_bytes == 57600


def test_kv_bytes_of_a_sink_model_by_hand(gpt_oss):
    """gpt-oss tiny: layers sliding (window 32), full, sliding; 2 KV heads x 16 dims, fp32. SnapKV at budget 32
    compresses the full layer to 32 entries: 32 x 2 heads x (16 + 16) x 4 = 8192 bytes; each sliding layer keeps
    the 31 entries its window still shows: 31 x 256 = 7936. Total 8192 + 2 x 7936 = 24064; the sinks are weights,
    not cache (full: 3 x 120 x 256 = 92160)."""
    ids = prompt(N)
    with AttentionCapture(gpt_oss, window=8) as capture:
        snap = generate(gpt_oss, None, configured("snapkv"), capture, ids, 32, 1, eos_ids=set())
    assert snap.kv_bytes == 24064 and snap.full_kv_bytes == 92160


# --- refusals and natural readings --------------------------------------------------------------------------------
def test_mla_refusals_are_one_line_and_name_what_runs():
    for name in ("tailorkv", "quest", "kvzap", "expected_attention", "critical_kv", "cam", "duo_attention"):
        assert latent_refusal(METHODS[name]) is not None, name
        with pytest.raises(ValueError) as err:
            check_latent(configured(name))
        message = str(err.value)
        assert message.startswith(f"MLA: method={name} ") and "\n" not in message and "snapkv" in message
    for name in ("snapkv", "pyramidkv", "h2o", "adakv", "kvzip", "streamingllm", "full"):
        assert latent_refusal(METHODS[name]) is None, name  # (adakv: one latent head, one dense index set)


def test_indexer_keys_follow_the_entries():
    """A DSA layer's indexer keys (DeepSeek-V3.2) are kept and freed with the entries they index."""
    layer = KVLayer()
    layer.update(torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 2))
    index = torch.arange(6.0)[None, :, None].expand(1, 6, 3).clone()
    assert layer.update_indexer(index).shape == (1, 6, 3)
    layer.keep(torch.tensor([[[0, 2, 5]]]))
    assert layer.indexer_keys[0, :, 0].tolist() == [0.0, 2.0, 5.0]
    assert layer.nbytes() == 3 * (4 + 2) * 4 + 3 * 3 * 4


def test_shift_and_shared_dsa_indexers_are_refused_before_weights_load(deepseek):
    """(DSA with an indexer per layer runs: tests/unit/test_generic_types.py)"""
    from kvbench.models.adapters import adapter_for, check_config

    with pytest.raises(ValueError, match="^MLA: positions=shift re-rotates cached keys"):
        adapter_for(deepseek).inv_freq(deepseek)
    assert check_config("deepseek_v32", config={"model_type": "deepseek_v32"}).indexed_layers  # (DSA runs)
    shared = {"model_type": "glm_moe_dsa", "num_hidden_layers": 2, "indexer_types": ["full", "shared"]}
    with pytest.raises(ValueError, match="MLA: its \"shared\" sparse-attention indexer layers"):
        check_config("glm_moe_dsa", config=shared)
    loader = importlib.import_module("kvbench.models.loader")
    assert loader.is_latent_model(loader.ModelSpec("tiny", "random:deepseek_v3"))
    assert not loader.is_latent_model(loader.ModelSpec("tiny", "random:gpt_oss"))


@pytest.mark.parametrize("name", ["snapkv", "adakv", "h2o", "full"])
def test_mla_batch_4_equals_batch_1(deepseek, name):
    """Batched decoding expands each latent row per head as the model does: batch 4 gives batch 1's tokens, bytes
    and kept entries (prompts of 5 lengths, samples leaving and joining; Ada-KV as one dense set per layer, H2O's
    evicting rows)."""
    from tests.unit.test_batching import assert_same, batch_one_and_batched

    method = configured(name)
    assert_same(*batch_one_and_batched(deepseek, method, None if name == "full" else 48, batch_size=4))
