"""`+method.quantize=kivi2` and `method=kivi` on tiny random models: the store holds exactly what the selector kept,
quantized as KIVI's quantizer does (an independent call of it on the kept entries), bytes by hand; Ada-KV's per-head
layers quantized per head; batch 4 equals batch 1; a fed question; the one-line refusals."""
from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import kvbench.methods  # noqa: F401
from kvbench.cache import KVCache
from kvbench.cache.quantized import QuantizedLayer
from kvbench.cache.quantized_heads import QuantizedHeads
from kvbench.cache.quantizer import quantize
from kvbench.engine.batching import Decoding, Request, generate, generate_batched
from kvbench.engine.generation import compress, prefill
from kvbench.methods.wrappers import Switches, wrap
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from kvbench.runs.config import CONFIG_DIR, setup
from tests.unit.tiny import prompt, tiny_model

N, BUDGET = 150, 64


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=3)


def quantized(name: str, residual: int = 32, **fields):
    return wrap(METHODS[name](**fields), Switches(quantize="kivi2", quantize_residual=residual))


def compressed(model, method, ids) -> KVCache:
    cache = KVCache()
    with AttentionCapture(model, window=method.query_window) as capture:
        prefill(model, ids, cache)
        compress(method, cache, capture, BUDGET)
    return cache


def test_snapkv_quantized_stores_snapkvs_entries_through_kivis_quantizer(model):
    ids = prompt(N)
    plain = compressed(model, METHODS["snapkv"](window=8), ids)
    packed = compressed(model, quantized("snapkv", window=8), ids)
    assert packed is not plain
    for kept, layer in zip(plain.layers, packed.layers):
        assert isinstance(layer, QuantizedLayer)
        keys, values = kept.keys, kept.values  # [1, 2, 64, 16]: 64 kept entries, residual 32
        expect_keys = quantize(keys, 2, 32, dim=-2, arithmetic="kivi").dequantize()  # 64 = 2 whole blocks
        expect_values = torch.cat([quantize(values[:, :, :32], 2, 16, arithmetic="kivi").dequantize(),
                                   values[:, :, 32:]], dim=-2)  # all but the last 32 values, groups of D = 16
        kv = layer.decode_kv()
        assert torch.equal(kv.keys, expect_keys) and torch.equal(kv.values, expect_values)
        # bytes by hand (fp32 model: KIVI keeps scale and zero in the cache's dtype, 4 bytes each), 2 KV heads
        key_bytes = 2 * (16 * 64 * 2 // 8 + 16 * (64 // 32) * 2 * 4)
        value_bytes = 2 * (32 * 16 * 2 // 8 + 32 * (16 // 16) * 2 * 4) + 2 * 32 * 16 * 4
        assert layer.nbytes() == key_bytes + value_bytes
        assert layer.entries_per_head() == [BUDGET, BUDGET]
    assert packed.nbytes() < plain.nbytes() / 2


def test_adakv_quantized_keeps_each_heads_entries_in_its_own_store(model):
    ids = prompt(N, seed=3)
    plain = compressed(model, METHODS["adakv"](window=8), ids)
    packed = compressed(model, quantized("adakv", window=8), ids)
    for kept, layer in zip(plain.layers, packed.layers):
        assert isinstance(layer, QuantizedHeads)
        assert layer.entries_per_head() == kept.entries_per_head()  # per-head lengths differ, as Ada-KV chose
        kv = layer.decode_kv()
        for h, (lo, hi) in enumerate(zip(kept.offsets, kept.offsets[1:])):
            n = hi - lo
            keys = kept.flat_keys[None, None, lo:hi]
            n_kq = n - n % 32
            expect = torch.cat([quantize(keys[:, :, :n_kq], 2, 32, dim=-2, arithmetic="kivi").dequantize(),
                                keys[:, :, n_kq:]], dim=-2) if n_kq else keys
            assert kv.valid[0, h].sum() == n and kv.valid[0, h, -n:].all()  # padded in front
            assert torch.equal(kv.keys[0, h, -n:], expect[0, 0])
    assert packed.nbytes() < plain.nbytes() / 2


@pytest.mark.parametrize("name", ["snapkv", "adakv", "kivi"])
def test_batch_of_four_equals_batch_one(model, name):
    method = METHODS["kivi"](residual=32) if name == "kivi" else quantized(name, window=8)
    prompts = [prompt(n, seed=i) for i, n in enumerate([150, 120, 210, 95])]
    with AttentionCapture(model, window=method.query_window) as capture:
        alone = [generate(model, None, method, capture, ids, BUDGET, 40, eos_ids=set()) for ids in prompts]
        requests = [Request(ids, BUDGET, 40, tag=i, decoding=Decoding(method)) for i, ids in enumerate(prompts)]
        together = {r.tag: g for r, g in generate_batched(model, None, method, capture, requests, 4, eos_ids=set())}
    for i, gen in enumerate(alone):  # 40 steps: a key block of 32 flushes and values slide while decoding
        assert together[i].token_ids == gen.token_ids
        assert together[i].kv_bytes == gen.kv_bytes and together[i].kv_bytes_final == gen.kv_bytes_final


def test_a_fed_question_joins_the_residual(model):
    """query=agnostic: the question is fed on top of SnapKV's quantized selection as a chunk and stored as if
    decoded token by token (kvbench.cache.quantized's append_chunk); the generation runs and stays quantized."""
    ids = prompt(N)
    method = quantized("snapkv", window=8)
    seen = []
    with AttentionCapture(model, window=method.query_window) as capture:
        gen = generate(model, None, method, capture, ids, BUDGET, 4, eos_ids=set(), question_len=20,
                       on_logits=lambda t, logits: seen.append([type(layer) for layer in capture.cache.layers]))
    assert seen and all(kinds == [QuantizedLayer] * 3 for kinds in seen)
    assert len(gen.token_ids) == 4 and gen.kept_per_head[0] == [BUDGET + 20] * 2


def run_setup(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["model=tiny_llama", *overrides])
    OmegaConf.set_struct(cfg, False)
    return setup(cfg)


@pytest.mark.parametrize("overrides, message", [
    (["method=h2o", "+method.quantize=kivi2"], "h2o is a decode-time evictor"),
    (["method=tailorkv", "+method.quantize=kivi2"], "tailorkv is a storage"),
    (["method=snapkv", "+method.quantize=kivi3"], "quantize='kivi3' is not one of kivi1, kivi2, kivi4, kivi8"),
    (["method=snapkv", "+method.quantize=kivi2", "+method.quantize_residual=40"], "multiple of group_size=32"),
    (["method=snapkv", "+method.quantize_residual=64"], "tune \\+method.quantize"),
    (["method=snapkv", "+method.quantize=kivi2", "decode_compression.target=64"], "snapkv\\+kivi2"),
    (["method=snapkv", "+method.quantize=kivi2", "positions=shift"], "positions=shift"),
    (["method=adakv", "+method.quantize=kivi2", "query=agnostic"], "query=agnostic: adakv\\+kivi2"),
    (["method=kivi", "method.bits=3"], "kivi: method.bits=3 is not one of 1, 2, 4, 8"),
    (["method=kivi", "method.arithmetic=exact"], "arithmetic='exact' is not one of tailorkv, kivi"),
])
def test_refused_in_one_line_before_weights_load(overrides, message):
    with pytest.raises(ValueError, match=message) as err:
        run_setup(*overrides)
    assert "\n" not in str(err.value)
