"""Tiny random GQA models built in-process (no download): Llama, Mistral, Qwen2."""
from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

FAMILIES = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}


def tiny_model(family: str = "llama", layers: int = 4, attn: str = "sdpa", seed: int = 0):
    config = FAMILIES[family](vocab_size=256, hidden_size=96, intermediate_size=128, num_hidden_layers=layers,
                              num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=4096)
    if family == "mistral":
        config.sliding_window = None
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()


def prompt(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(seed))


@contextmanager
def attention_function(model, fn, name: str = "test_reference"):
    """Run `model` with `fn` as its attention function (a test's independent reference), then restore the model's
    own implementation."""
    original = model.config._attn_implementation
    AttentionInterface.register(name, fn)
    model.set_attn_implementation(name)
    try:
        with torch.no_grad():
            yield
    finally:
        model.set_attn_implementation(original)
        AttentionInterface._global_mapping.pop(name, None)


def kept_by_kvbench(model, ids, method, budget: int):
    """Original positions `[H_kv, budget]` per layer right after kvbench's prefill compression (kvpress's presses
    are checked against these)."""
    from kvbench.cache import KVCache
    from kvbench.engine.generation import compress, prefill
    from kvbench.models import AttentionCapture

    cache = KVCache()
    with AttentionCapture(model, window=method.query_window) as capture:
        prefill(model, ids, cache)
        compress(method, cache, capture, budget)
    return [layer.positions[0] for layer in cache.layers]


def decoding_selections(model, method, ids, budget: int, new: int, setting, record) -> list:
    """What `record(capture, method, view, n_keep, idx)` returned at each of `method`'s selections while decoding
    under `setting` (a `DecodeCompression`; the prefill's selection is left out), its class's `select` wrapped for
    one generation."""
    from kvbench.engine.batching import generate
    from kvbench.models import AttentionCapture

    calls, real_select = [], type(method).select
    with AttentionCapture(model, window=method.query_window) as capture:
        def recording_select(self, view, n_keep):
            idx = real_select(self, view, n_keep)
            if capture.cache is not None:  # decoding
                calls.append(record(capture, self, view, n_keep, idx))
            return idx

        type(method).select = recording_select
        try:
            generate(model, None, method, capture, ids, budget, new, eos_ids=set(), recompress=setting)
        finally:
            type(method).select = real_select
    return calls
