"""Every registered method, at two budgets, on each tiny model family: the cache shrinks to the budget (decode-time
methods stay within it while generating), kept keys keep their original positions, and no hook is left behind.
A new method is covered as soon as it is registered and has a YAML. Every other decoder family (Qwen3, Phi-3,
GPT-NeoX, GPT-2, Gemma 2/3, MPT, GPT-J, Falcon) x every method: tests/unit/test_families.py."""
from __future__ import annotations

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf
from transformers import AttentionInterface

import kvbench.methods  # noqa: F401
from kvbench.engine.batching import generate
from kvbench.methods.base import Kind
from kvbench.methods.decoding import DecodingMethod
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from kvbench.runs.config import CONFIG_DIR
from tests.unit.tiny import prompt, tiny_model

N, NEW = 150, 12


def configured(name: str):
    """The method exactly as its YAML configures it, with windows shrunk to fit tiny budgets."""
    cfg = OmegaConf.load(CONFIG_DIR / "method" / f"{name}.yaml")
    if "window" in cfg and cfg.window is not None:
        cfg.window = 8
    if name == "tailorkv":  # 4 sinks + 12 recent; layer 0 quantized (its YAML reads the model config's set)
        cfg.update(start_size=4, recent_size=12, quant_layers=[0])
    if name == "kivi":  # a residual of 32 of the 150 tokens, so that most of them are quantized
        cfg.update(residual=32)
    if name == "pqcache":  # 4 sinks + 8 recent; 16 centroids (the 150-token prompt has 146 keys to cluster)
        cfg.update(sink_size=4, recent_size=8, bits=4)
    if "prompt_ids" in cfg:  # kvzip, kvgrad: prompts as token ids of the tiny vocabulary (no tokenizer); chunks of 64
        cfg.update(chat_template=False, chunk_size=64, prompt_ids=[[5, 6, 7], [8, 9, 10, 11], [12]])
    if name == "simlayerkv":  # every layer lazy: a random model's attention is nowhere near a real threshold
        cfg.update(lazy_threshold=0.0)
    if name in ("dms", "kvzap"):  # thresholds that evict about half of the tiny model's entries (-‖k‖ ~ -0.8);
        cfg.update(threshold=-0.8 if name == "dms" else 0.0)  # kvzap: a seeded random surrogate shaped for it
        if name == "kvzap":
            cfg.update(weights="random")
    if name == "quest":  # pages of 8: budgets 32 and 64 are 4 and 8 pages of the 150 tokens; layer 0 dense
        cfg.update(page_size=8, dense_layers=1)
    if name == "duo_attention":  # streaming heads keep 4 sinks + 8 recent (its pattern: 128 + 256)
        cfg.update(sink_size=4, recent_size=8)
    if name == "minicache":  # layers 0 and 1 of 3 merged
        cfg.update(start_layer=0)
    if name == "gear":  # value groups of 16 channels (a token's 2 KV heads x 16)
        cfg.update(group_size=16)
    if name == "kvquant":  # key groups of 16 of the 150 tokens
        cfg.update(group_size=16)
    return instantiate(cfg)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("name", METHODS.names())
def test_method_contract(name, family):
    model, ids = tiny_model(family, layers=3), prompt(N)
    method = configured(name)
    for budget in (32, 64):
        method.check_budget(budget)
        with AttentionCapture(model, window=getattr(method, "window", 0)) as capture:
            gen = generate(model, None, method, capture, ids, budget, NEW, eos_ids=set())
            for layer in capture.cache.layers if capture.cache is not None else []:
                positions = (layer.flat_positions if getattr(layer, "is_varlen", False) else layer.positions)
                if positions is not None and positions.numel():  # (a quantized layer keeps every token in order)
                    assert positions.min() >= 0 and positions.max() < N + NEW  # original positions survive
        assert model.config._attn_implementation == "sdpa"
        assert capture.name not in AttentionInterface._global_mapping
        assert len(gen.token_ids) == NEW
        if name == "full":
            assert gen.kv_bytes == gen.full_kv_bytes
            continue
        per_entry = gen.full_kv_bytes / (N * model.config.num_key_value_heads * model.config.num_hidden_layers)
        heads = max(len(layer) for layer in gen.kept_per_head)
        mean_kept = gen.kv_bytes / per_entry / heads / model.config.num_hidden_layers
        if name in ("minicache", "gear", "kvquant"):  # layers merged or compressed, not entries: every token stays
            assert all(kept == [N] * len(kept) for kept in gen.kept_per_head)
            assert gen.kv_bytes < gen.full_kv_bytes
            continue
        if name == "kivi":  # every entry kept, packed: 2-bit codes + fp16 scales/zeros + the fp residual
            assert all(kept == [N] * len(kept) for kept in gen.kept_per_head)
            assert gen.kv_bytes < gen.full_kv_bytes / 2
            continue
        if method.kind is Kind.STORAGE:  # storage: retrieval layers attend exactly `budget` prompt entries
            layers = model.config.num_hidden_layers
            sparse = gen.kept_per_head[method.dense_layers:] if name == "quest" else gen.kept_per_head[1:]
            assert all(kept == [budget] * len(kept) for kept in sparse)
            if name == "quest":  # the whole cache stays, with 2 x D of page metadata per page and KV head
                meta = 2 * 19 * model.config.num_key_value_heads * 16 * 4 * (layers - method.dense_layers)
                assert gen.kv_bytes == gen.full_kv_bytes + meta and gen.host_kv_bytes == 0
                continue
            assert gen.kv_bytes < gen.full_kv_bytes
            if name == "tailorkv":  # host: K, V and Kᵀ of every offloaded layer
                assert gen.host_kv_bytes == 1.5 * gen.full_kv_bytes * (layers - 1) / layers
            else:  # PQCache host: K/V of the candidates (with room to grow), 1-byte codes, centroids
                assert gen.host_kv_bytes > gen.full_kv_bytes * (N - 12 - NEW) / N
        elif isinstance(method, DecodingMethod):  # evicting while generating: never above the budget
            assert max(max(layer) for layer in gen.kept_per_head) <= budget
            assert gen.kv_bytes_final / per_entry / heads / model.config.num_hidden_layers <= budget
        elif method.threshold_budget:  # what a threshold keeps is an outcome: no more than the prompt, window kept
            assert gen.kv_bytes <= gen.full_kv_bytes
            assert min(min(layer) for layer in gen.kept_per_head) >= min(method.kept_window, N)
        else:  # one-shot: the mean kept per head is the budget (pyramid rounding may add a few percent)
            assert budget * 0.9 <= mean_kept <= budget * 1.35, (name, budget, mean_kept)
            assert gen.kv_bytes < gen.full_kv_bytes


@pytest.mark.parametrize("name", METHODS.names())
def test_method_declares_what_it_is(name):
    """`kind` is what the engine dispatches on, so it must match what the class implements: a selector's `select`
    (or `full`, which keeps everything), an evictor's `evict` (a DecodingMethod), a storage method's `attach`."""
    method = configured(name)
    cls = type(method)
    implements = {Kind.SELECTOR: cls.select is not kvbench.methods.Method.select or not method.compresses,  # full
                  Kind.EVICTOR: isinstance(method, DecodingMethod),
                  Kind.STORAGE: callable(getattr(cls, "attach", None)),
                  Kind.RECONSTRUCTOR: callable(getattr(cls, "select_all", None))}
    assert [kind for kind, yes in implements.items() if yes] == [method.kind], (name, implements)
    expected = {"full": Kind.SELECTOR, "snapkv": Kind.SELECTOR, "h2o": Kind.EVICTOR, "tailorkv": Kind.STORAGE,
                "quest": Kind.STORAGE, "pqcache": Kind.STORAGE, "kvzip": Kind.RECONSTRUCTOR}
    assert method.kind is expected.get(name, method.kind)
    # only a selector's `select` reads window queries (the others score from column sums or their own pass)
    assert method.query_window >= 0 and (method.kind is Kind.SELECTOR or method.query_window == 0)
    if method.kept_window and not method.threshold_budget:  # the kept window counts inside the budget, so no
        #                                                        budget up to it is accepted (a threshold's ignores it)
        with pytest.raises(ValueError, match=name):
            method.check_budget(method.kept_window)
