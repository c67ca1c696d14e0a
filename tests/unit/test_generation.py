"""Decoding through the compressed cache: equivalence with the full cache, positions, and real byte counts."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache

import kvbench.methods  # noqa: F401
from kvbench.cache import KVCache
from kvbench.engine.generation import Sampling, compress, prefill
from kvbench.engine.batching import generate
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from kvbench.models.loader import RANDOM_FAMILIES
from kvbench.models.tiny import tiny_random_model
from tests.unit.tiny import attention_function, prompt, tiny_model

N, NEW = 200, 12


def run(model, name, budget, ids, eos_ids=frozenset(), **kwargs):
    method = METHODS[name](**kwargs)
    seen = []
    with AttentionCapture(model, window=getattr(method, "window", 0)) as capture:
        gen = generate(model, None, method, capture, ids, budget, NEW, eos_ids=set(eos_ids),
                       on_logits=lambda t, logits: seen.append(logits.clone()))
    return gen, seen


WINDOWED = {"snapkv": {"window": 8}, "pyramidkv": {}, "streamingllm": {}}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_full_equals_model_generate(family):
    model, ids = tiny_model(family), prompt(N)
    eos = model.generation_config.eos_token_id
    expected = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=eos)[0, N:].tolist()
    if eos in expected:  # generate() returns the EOS token itself; kvbench stops before it
        expected = expected[: expected.index(eos)]
    gen, _ = run(model, "full", None, ids, eos_ids={eos})
    assert gen.token_ids == expected and len(expected) >= 1


@pytest.mark.parametrize("name", sorted(WINDOWED))
@pytest.mark.parametrize("budget", [N, N + 50])
def test_budget_at_or_above_prompt_equals_full_exactly(name, budget):
    model, ids = tiny_model("llama"), prompt(N)
    full, full_logits = run(model, "full", None, ids)
    gen, logits = run(model, name, budget, ids, **WINDOWED[name])
    assert gen.token_ids == full.token_ids
    assert all(torch.equal(a, b) for a, b in zip(logits, full_logits))
    assert gen.kv_bytes == full.kv_bytes


@pytest.mark.parametrize("name", sorted(WINDOWED))
def test_first_token_equals_full_under_compression(name):
    model, ids = tiny_model("mistral"), prompt(N)
    _, full_logits = run(model, "full", None, ids)
    _, logits = run(model, name, 32 if name != "snapkv" else 40, ids, **WINDOWED[name])
    assert torch.equal(logits[0], full_logits[0])  # prefill attends over the whole prompt
    assert not torch.equal(logits[1], full_logits[1])  # and the cache really is smaller afterwards


def kept_positions(layer) -> list[torch.Tensor]:
    """Original positions kept per stored head, for dense and per-head variable layers alike."""
    if getattr(layer, "is_varlen", False):
        return list(layer.flat_positions.split(layer.head_lens.tolist()))
    return list(layer.positions[0].clone())


@pytest.mark.parametrize("name,granularity", [("snapkv", "kv_head"), ("snapkv", "query_head"),
                                              ("adakv", "kv_head"), ("adakv", "query_head")])
def test_decode_after_eviction_equals_masked_dense_recompute(name, granularity):
    """Our decode logits equal attention over the *uncompressed* cache masked, per query head, to the kept original
    positions plus the new token at position N (not at the cache length): independent of kvbench's cache code."""
    model, ids = tiny_model("llama"), prompt(N)
    method = METHODS[name](window=8, granularity=granularity)
    cache = KVCache()
    with AttentionCapture(model, window=8) as capture:
        logits = prefill(model, ids, cache)
        compress(method, cache, capture, 48)
        kept = [kept_positions(layer) for layer in cache.layers]  # per layer: [k_h] per stored head
        token = logits.argmax(-1, keepdim=True)
        ours = model(token, past_key_values=cache, position_ids=torch.tensor([[N]])).logits[:, -1]

    n_heads = model.config.num_attention_heads

    def masked(module, q, k, v, mask, scaling=None, **kw):
        per_head = kept[module.layer_idx]
        allowed = torch.zeros(n_heads, k.shape[2], dtype=torch.bool)
        for hq in range(n_heads):  # query head hq reads stored head hq * H_stored // H_q
            allowed[hq, per_head[hq * len(per_head) // n_heads]] = True
        allowed[:, -1] = True  # the new token
        k, v = k.repeat_interleave(n_heads // k.shape[1], 1), v.repeat_interleave(n_heads // v.shape[1], 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[None, :, None, :], scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    with torch.no_grad():
        reference = DynamicCache()
        model(ids, past_key_values=reference, use_cache=True)  # plain full prefill
    with attention_function(model, masked):
        expected = model(token, past_key_values=reference, position_ids=torch.tensor([[N]])).logits[:, -1]
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,granularity", [("snapkv", "kv_head"), ("snapkv", "query_head"),
                                              ("pyramidkv", "kv_head"), ("pyramidkv", "query_head"),
                                              ("streamingllm", "kv_head")])
def test_physical_bytes_match_kept_entries(name, granularity):
    model, ids = tiny_model("llama"), prompt(N)
    kwargs = dict(WINDOWED[name])
    if name != "streamingllm":
        kwargs["granularity"] = granularity
    gen, _ = run(model, name, 64, ids, **kwargs)
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    heads = cfg.num_attention_heads if granularity == "query_head" else cfg.num_key_value_heads
    per_entry = 2 * head_dim * 4  # K and V, fp32
    assert gen.kv_bytes == sum(sum(layer) for layer in gen.kept_per_head) * per_entry
    assert all(len(layer) == heads for layer in gen.kept_per_head)
    assert gen.full_kv_bytes == cfg.num_hidden_layers * cfg.num_key_value_heads * N * per_entry
    assert gen.kv_bytes < gen.full_kv_bytes
    assert gen.kv_bytes_final == gen.kv_bytes + cfg.num_hidden_layers * heads * (NEW - 1) * per_entry


def test_capture_is_per_instance_and_removed_on_exit():
    a, b, ids = tiny_model("llama"), tiny_model("llama", seed=1), prompt(64)
    with torch.no_grad():
        before = b(ids).logits
        with AttentionCapture(a, window=8) as capture:
            assert a.config._attn_implementation == capture.name
            assert b.config._attn_implementation == "sdpa"
            after = b(ids).logits
        assert a.config._attn_implementation == "sdpa"
        assert capture.name not in AttentionInterface._global_mapping
    assert torch.equal(before, after)


def test_sampling_is_seeded():
    model, ids = tiny_model("llama"), prompt(64)
    method = METHODS["full"]()
    with AttentionCapture(model) as capture:
        runs = [generate(model, None, method, capture, ids, None, 8, eos_ids=set(),
                         sampling=Sampling(do_sample=True, temperature=1.5, top_p=0.9, seed=s)).token_ids
                for s in (1, 1, 2)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_stop_tokens_and_min_new_tokens_follow_hf_semantics():
    """A stop token ends generation (excluded), as an extra HF eos id; min_new_tokens forbids it at step 0."""
    model, ids = tiny_model("llama"), prompt(64)
    method = METHODS["full"]()
    with AttentionCapture(model) as capture:
        free = generate(model, None, method, capture, ids, None, 8, eos_ids=set()).token_ids
        cut = generate(model, None, method, capture, ids, None, 8, eos_ids=set(), stop_token_ids=(free[2],))
        first = generate(model, None, method, capture, ids, None, 8, eos_ids=set(), stop_token_ids=(free[0],))
        forced = generate(model, None, method, capture, ids, None, 8, eos_ids=set(), stop_token_ids=(free[0],),
                          min_new_tokens=1)
    assert cut.token_ids == free[: free.index(free[2])]
    assert first.token_ids == []
    assert forced.token_ids and forced.token_ids[0] != free[0]  # the next-best token instead


@pytest.mark.parametrize("family", RANDOM_FAMILIES)
def test_full_cache_through_the_engine_equals_transformers_generate_on_every_family(family):
    """Batch 1 is a batch of one through the engine's step: every family (attention replaced, windowed, soft-capped
    included) decodes exactly what transformers' own greedy `generate` does with its own cache."""
    model = tiny_random_model(family, layers=2, seed=1)
    ids = prompt(64)
    expected = model.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8,
                              pad_token_id=0)[0, 64:].tolist()
    with AttentionCapture(model) as capture:
        gen = generate(model, None, METHODS["full"](), capture, ids, None, 8, eos_ids=set())
    assert gen.token_ids == expected and len(expected) == 8
