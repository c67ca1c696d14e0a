"""Hybrid models (linear attention, Gated DeltaNet, Mamba, short-conv layers beside attention), on tiny random models
of each type built from transformers' own config classes (kvbench.models.tiny.HYBRID_TINY).

- The full cache generates exactly the greedy tokens of transformers' own `generate` on the same model (the
  recurrent state kept by transformers' rules, in kvbench's cache).
- Compress, then one decode step equals a recomputation over transformers' own uncompressed `DynamicCache`, the
  model's recurrent layers left as they are, and each attention layer through the model's own eager attention
  function masked, per query head, to the positions kvbench kept (independent of kvbench's cache and capture).
- `kv_bytes` counts the attention layers' K/V only and shrinks with the budget, hand-worked; the recurrent state is
  reported apart (`state_bytes`), equal to the bytes transformers' own cache holds for it.
- batch_size=4 gives batch 1's generations; beams carry the state; refusals are one line.
"""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.models.minimax.modeling_minimax import MiniMaxCache
from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

import kvbench.methods  # noqa: F401
from kvbench.engine.batching import Request, generate, generate_batched
from kvbench.methods.base import Kind
from kvbench.models import AttentionCapture
from kvbench.models.adapters import adapter_for, check_config
from kvbench.models.loader import RANDOM_HYBRIDS, RANDOM_LATENT_HYBRIDS
from kvbench.models.tiny import tiny_random_model
from kvbench.registry import METHODS
from kvbench.cache.quantized import QuantizedLayer
from tests.unit.test_families import EVERY_TOKEN, RETRIEVING, attended_positions, configured
from tests.unit.tiny import prompt

N, BUDGET = 120, 32
CORE = ("full", "snapkv", "adakv", "h2o", "tailorkv", "kvzip")  # a method of every kind (selector, per-head,
# evictor, storage, reconstructor) on every hybrid; the rest of the registry on Qwen3.5
_models: dict[str, torch.nn.Module] = {}


def model_of(model_type: str):
    if model_type not in _models:
        _models[model_type] = tiny_random_model(model_type)
    return _models[model_type]


def own_cache(model) -> DynamicCache:
    """transformers' own empty cache for `model` (MiniMax takes no class but its `MiniMaxCache`, whose unused K/V
    slots of lightning layers stay empty: `attention_layers` skips them)."""
    return MiniMaxCache() if model.config.model_type == "minimax" else DynamicCache(config=model.config)


def reference_cache(model, ids) -> DynamicCache:
    """transformers' own cache after the uncompressed prompt (its linear layers' state by its own rules)."""
    cache = own_cache(model)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    return cache


def attention_layers(cache: DynamicCache) -> list[int]:
    """Model layers whose cache holds per-token K/V (Falcon-H1's hold both K/V and state)."""
    return [i for i, layer in enumerate(cache.layers) if isinstance(layer, CacheLayerMixin) and layer.is_initialized]


def masked_step(model, ids, token, kept: dict[int, list[torch.Tensor] | None]):
    """One decode step at position N on transformers' uncompressed cache, each attention layer through the model's
    own eager attention function with every query head restricted to `kept[model layer][stored head]` (None: all)
    plus the new token, and in a sliding-window layer (LFM3) to the window its config gives (the bias replaces the
    model's own mask)."""
    reference = reference_cache(model, ids)
    own = adapter_for(model).eager_function()
    n_heads = model.config.num_attention_heads
    modules, numbers = adapter_for(model).attention_modules(model), adapter_for(model).layer_numbers(model)
    layer_of = {id(modules[slot]): layer for slot, layer in numbers.items()}  # (Zamba's blocks: layer_idx None / -1)

    def masked(module, q, k, v, mask, **kw):
        per_head = kept[layer_of[id(module)]]
        allowed = torch.ones(n_heads, N + 1, dtype=torch.bool)  # over positions 0..N
        if per_head is not None:
            allowed[:] = False
            for hq in range(n_heads):
                allowed[hq, per_head[hq * len(per_head) // n_heads]] = True
            allowed[:, -1] = True
        if (getattr(model.config, "layer_types", None) or [None] * 99)[layer_of[id(module)]] == "sliding_attention":
            allowed &= torch.arange(N + 1) > N - model.config.sliding_window  # visible while N - p < window
        allowed = allowed[:, N + 1 - k.shape[2]:]  # (transformers' sliding layer holds the last window positions)
        bias = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, :, None]
        return own(module, q, k, v, bias, **kw)

    from tests.unit.tiny import attention_function

    with attention_function(model, masked):
        return model(token, past_key_values=reference, position_ids=torch.tensor([[N]])).logits[:, -1]


def check_contract(model_type: str, name: str) -> None:
    model, ids = model_of(model_type), prompt(N)
    method = configured(name)
    seen: dict = {}

    def on_logits(t, logits):
        if t == 0:
            layers = capture.cache.layers if capture.cache is not None else None
            seen["layers"] = layers
            seen["kept"] = None if layers is None else [
                None if isinstance(layer, (*RETRIEVING, QuantizedLayer)) else attended_positions(layer)
                for layer in layers]  # (KIVI: every position)
            for layer in layers or []:
                if isinstance(layer, RETRIEVING):
                    layer.selections = []
        elif t == 1:
            seen["logits"] = logits.clone()

    with AttentionCapture(model, window=getattr(method, "window", 0)) as capture:
        gen = generate(model, None, method, capture, ids, BUDGET, 2, eos_ids=set(), on_logits=on_logits)
    attn = attention_layers(reference_cache(model, ids))
    kept_by_slot = seen["kept"] or [None] * len(attn)
    for slot, layer in enumerate(seen["layers"] or []):  # what a retrieving layer attended at that step
        kept_by_slot[slot] = retrieved(layer, kept_by_slot[slot])
    kept = {layer: kept_by_slot[slot] for slot, layer in enumerate(attn)}
    expected = masked_step(model, ids, torch.tensor([gen.token_ids[:1]]), kept)
    torch.testing.assert_close(seen["logits"], expected, rtol=1e-4, atol=1e-4)
    if name == "full":
        assert gen.kv_bytes == gen.full_kv_bytes
        return
    if name == "kivi":  # every token kept (all in the full-precision residual, as configured()), in its own layers
        assert all(isinstance(layer, QuantizedLayer) for layer in seen["layers"])
        return
    compressed = [s for s in range(len(attn)) if not (name == "quest" and s < method.dense_layers)
                  and name not in EVERY_TOKEN]  # (they store every token, in fewer bytes)
    for slot in compressed:  # every attention layer really shrank
        assert max(len(p) for p in kept_by_slot[slot]) < N
    if method.kind is not Kind.STORAGE:  # bytes held = Σ kept entries x (K + V widths) x 4 bytes (fp32; an MLA
        widths = seen["layers"][0].keys.shape[-1] + seen["layers"][0].values.shape[-1]  # latent: c_kv + k_rope)
        assert gen.kv_bytes == sum(len(p) for layer in kept_by_slot for p in layer) * widths * 4
    assert len(gen.kept_per_head) == len(attn)  # the record counts attention layers only


def retrieved(layer, kept):
    """The positions a retrieving layer (TailorKV's offloaded, Quest's pages, PQCache) attended at step 1."""
    from kvbench.cache.offloaded import OffloadedLayer
    from kvbench.cache.paged import PagedLayer
    from kvbench.cache.pq_offloaded import PQOffloadedLayer

    if isinstance(layer, OffloadedLayer):  # sinks + recent + what it retrieved
        static = torch.cat([torch.arange(4), torch.arange(N - 8, N)])
        return [torch.cat([static, top]) for top in layer.selections[0][1][0]]
    if isinstance(layer, PagedLayer) and layer.selections:
        pages = [(p[:, None] * 8 + torch.arange(8)).flatten() for p in layer.selections[0][0]]
        return [p[p <= N] for p in pages]
    if isinstance(layer, PQOffloadedLayer):
        static = torch.cat([torch.arange(4), torch.arange(N - 8, N)])
        return [torch.cat([static, top]) for top in layer.selections[0][0]]
    return kept


@pytest.mark.parametrize("model_type", RANDOM_HYBRIDS + RANDOM_LATENT_HYBRIDS)
def test_full_cache_generates_what_transformers_generates(model_type):
    model, ids = model_of(model_type), prompt(48, seed=3)
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=8, do_sample=False)[0, 48:].tolist()
    with AttentionCapture(model) as capture:
        gen = generate(model, None, configured("full"), capture, ids, None, 8, eos_ids=set())
    assert gen.token_ids == expected


@pytest.mark.parametrize("name", CORE)
@pytest.mark.parametrize("model_type", RANDOM_HYBRIDS)
def test_compress_then_decode_equals_masked_recompute(model_type, name):
    check_contract(model_type, name)


@pytest.mark.parametrize("name", sorted(set(METHODS.names()) - set(CORE)))
def test_every_method_keeps_the_contract_on_qwen3_5(name):
    check_contract("qwen3_5_text", name)


def test_kv_bytes_count_attention_layers_and_shrink_with_the_budget():
    """Qwen3.5 tiny: one attention layer (2 KV heads, head_dim 16, fp32) beside two Gated DeltaNet layers.
    Full: 120 entries x 2 heads x 16 x (K + V) x 4 bytes = 30720; SnapKV at budget 32: 32 x 2 x 16 x 2 x 4 = 8192,
    the tensors the layer holds. The state: per DeltaNet layer a conv state [1, 2 x 2 x 8 + 4 x 8 = 64, kernel 4]
    and a recurrent state [1, 4 value heads, 8, 8], fp32: (256 + 256) x 4 = 2048 bytes, 4096 for both, whatever
    the budget, and what transformers' own cache holds."""
    model, ids = model_of("qwen3_5_text"), prompt(N)
    held = {}
    for name, budget in (("full", None), ("snapkv", 32), ("snapkv", 64)):
        with AttentionCapture(model, window=8) as capture:
            gen = generate(model, None, configured(name), capture, ids, budget, 1, eos_ids=set(),
                           on_logits=lambda t, _: held.setdefault((name, budget), [
                               layer.keys.numel() * 4 + layer.values.numel() * 4 for layer in capture.cache.layers]
                               if capture.cache is not None else None))
        assert gen.state_bytes == 4096
        held[(name, budget, "gen")] = gen.kv_bytes
    assert held[("full", None, "gen")] == 30720
    assert held[("snapkv", 32, "gen")] == 8192 == sum(held[("snapkv", 32)])
    assert held[("snapkv", 64, "gen")] == 16384 == sum(held[("snapkv", 64)])
    reference = reference_cache(model, ids)
    linear = [layer for layer in reference.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]
    assert sum(t.numel() * t.element_size() for layer in linear
               for t in (*layer.conv_states.values(), *layer.recurrent_states.values())) == 4096


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "jamba", "falcon_h1"])
def test_batch_of_four_equals_batch_one(model_type):
    """Four prompts of different lengths decoding together: each sample's state goes into the batched forward and
    back (the conv state is updated in place at a decode step), and every generation equals batch 1's."""
    model = model_of(model_type)
    prompts, new = [prompt(n, seed=i) for i, n in enumerate((70, 40, 95, 55))], [6, 3, 6, 5]
    method = configured("snapkv")
    with AttentionCapture(model, window=method.query_window) as capture:
        alone = [generate(model, None, method, capture, ids, BUDGET, k, eos_ids=set()) for ids, k in zip(prompts, new)]
        requests = [Request(ids, BUDGET, k, tag=i) for i, (ids, k) in enumerate(zip(prompts, new))]
        done = {r.tag: g for r, g in generate_batched(model, None, method, capture, requests, 4, eos_ids=set())}
    for i, one in enumerate(alone):
        assert done[i].token_ids == one.token_ids and done[i].kv_bytes == one.kv_bytes
        assert done[i].state_bytes == one.state_bytes > 0


def test_beam_search_carries_the_state_with_its_beams():
    """Three beams with the full cache equal transformers' own beam search: each beam's recurrent state is
    gathered with its cache rows (transformers' `reorder_cache`)."""
    from kvbench.engine.beam import beam_generate
    from tests.unit.test_beam import hf_beams

    model, ids = model_of("qwen3_5_text"), prompt(40)
    with torch.no_grad():
        greedy = model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=2)[0, 40:].tolist()
        expected = hf_beams(model, ids, 2, 3, False)
    assert expected != greedy  # the search really differs from greedy on this prompt
    with AttentionCapture(model) as capture:
        gen = beam_generate(model, None, configured("full"), capture, ids, None, 10, 3, eos_ids={2})
    assert gen.token_ids == expected


@pytest.mark.parametrize("model_type,reason", [
    ("recurrent_gemma", "hybrid: it keeps its cache inside the model"),
    ("mamba", "state-space/recurrent model with no per-token KV"),
])
def test_hybrids_that_cannot_run_are_refused_in_one_line(model_type, reason):
    with pytest.raises(ValueError, match=reason) as err:
        check_config(model_type)
    assert "\n" not in str(err.value)


def test_hybrid_with_rotary_per_layer_type_refuses_position_shift():
    """ZAYA keeps its rotary frequencies per layer type (`hybrid_inv_freq`): refused in one line, not an AttributeError
    (LFM3's sliding/global mix is refused as a window mix)."""
    for model_type, reason in (("zaya", "kept per layer type"), ("lfm3", "mixes sliding-window and global")):
        model, ids = model_of(model_type), prompt(40)
        with AttentionCapture(model) as capture, pytest.raises(ValueError, match=f"positions=shift: .*{reason}") as err:
            generate(model, None, configured("streamingllm"), capture, ids, BUDGET, 2, eos_ids=set(),
                     positions="shift")
        assert "\n" not in str(err.value)


def test_nope_hybrid_refuses_position_shift():
    model, ids = model_of("jamba"), prompt(40)
    with AttentionCapture(model) as capture, pytest.raises(ValueError, match="positions=shift: jamba has none"):
        generate(model, None, configured("streamingllm"), capture, ids, BUDGET, 2, eos_ids=set(), positions="shift")


def test_cli_runs_a_hybrid_and_batch_four_gives_batch_one_records(tmp_path):
    """`python -m kvbench.run model.path=random:<hybrid>` (in this process, `run_here`): snapkv, adakv, h2o,
    tailorkv and full on Qwen3.5 each write their records, the state apart from the attention K/V; Jamba at
    batch_size=4 writes batch 1's records, timings aside."""
    from tests.unit.test_cli import records, run_here

    grid = ["dataset.context_lengths=[400]", "dataset.depth_percents=[0,50,100]",
            "dataset.max_new_tokens=8"]  # (not 30: eight steps show the batched decode; the records are the point)
    timing = ("prefill_s", "compress_s", "decode_s", "decode_tok_s", "e2e_s", "peak_mem_bytes")
    for name in ("full", "snapkv", "adakv", "h2o", "tailorkv"):
        run_dir = run_here("model.path=random:qwen3_5_text", f"method={name}", "budget=128", *grid, "report=false",
                           results=tmp_path / name)
        got = records(run_dir)
        assert len(got) == 3 and not any(r.get("failed") for r in got)
        assert all(r["state_bytes"] == 4096 and len(r["kept_per_layer"]) == 1 for r in got)  # one attention layer
        if name != "full":
            assert all(r["kv_bytes"] < r["full_kv_bytes"] for r in got)
    runs = {}
    for batch_size in (1, 4):
        run_dir = run_here("model.path=random:jamba", "method=snapkv", "budget=128", *grid, "report=false",
                           f"batch_size={batch_size}", results=tmp_path / f"b{batch_size}")
        runs[batch_size] = {r["id"]: {k: v for k, v in r.items() if k not in timing} for r in records(run_dir)}
    assert runs[4] == runs[1] and len(runs[1]) == 3


@pytest.mark.parametrize("model_type", RANDOM_HYBRIDS)
def test_predicted_query_is_the_attention_layers_own_query(model_type):
    """TailorKV's q̂ on a hybrid: the adapter's projection (the query half of Qwen3.5's gated `q_proj`, OLMo-hybrid's
    whole-projection norm, LFM2's `q_layernorm`, NoPE or partial rotary) of the attention layer's decode input equals
    the query the attention module itself forms from it; ZAYA's queries also read a conv state, so it refuses in one
    line (and can_predict says no, so TailorKV takes each layer's own query)."""
    from tests.unit.tiny import attention_function

    model, ids = model_of(model_type), prompt(40)
    with AttentionCapture(model) as capture:
        seen = {}
        capture.input_hook = lambda i, hidden, pos: seen.setdefault(i, (hidden, pos))
        with torch.no_grad():
            cache = own_cache(model)
            model(ids, past_key_values=cache, use_cache=True)
            model(ids[:, :1], past_key_values=cache, position_ids=torch.tensor([[40]]), use_cache=True)
        hidden, pos = seen[0]
        if not capture.adapter.query_predictable:
            assert not capture.can_predict(1)
            with pytest.raises(NotImplementedError, match="channel_query=current") as err:
                capture.predict_query(0, hidden, pos)
            assert "\n" not in str(err.value)
            return
        predicted = capture.predict_query(0, hidden, pos)
        attn = capture.attention_modules[0]
    grabbed = {}

    def grab(module, q, k, v, mask, **kw):
        grabbed["q"] = q
        return torch.zeros(q.shape[0], q.shape[2], q.shape[1], q.shape[3]), None

    with attention_function(model, grab):
        attn(hidden_states=hidden, position_embeddings=pos, attention_mask=None)
    torch.testing.assert_close(predicted, grabbed["q"])


def test_position_shift_on_zamba2_equals_its_own_rope():
    """StreamingLLM with positions=shift on Zamba 2 (rotary attention blocks numbered by layer): the next step equals
    transformers' own cache after the prompt with each attention layer cut to the kept entries, keys re-rotated from
    position p to slot s by Zamba 2's own `apply_rotary_pos_emb`, the Mamba state left as it is."""
    import importlib

    n, budget = 120, 32
    model, ids = model_of("zamba2"), prompt(n)
    method = configured("streamingllm")
    seen = {}
    with AttentionCapture(model) as capture:
        gen = generate(model, None, method, capture, ids, budget, 2, eos_ids=set(), positions="shift",
                       on_logits=lambda t, logits: seen.setdefault(t, logits.clone()))
    keep = torch.cat([torch.arange(method.n_sink), torch.arange(n - (budget - method.n_sink), n)])
    apply_rope = importlib.import_module(type(model).__module__).apply_rotary_pos_emb
    reference = reference_cache(model, ids)
    with torch.no_grad():
        cos, sin = model.base_model.rotary_emb(reference.layers[1].values, (torch.arange(budget) - keep)[None])
        for i in attention_layers(reference):
            layer = reference.layers[i]
            k, v = layer.keys[:, :, keep], layer.values[:, :, keep]
            layer.keys, layer.values = apply_rope(k, k, cos, sin)[0], v
        expected = model(torch.tensor([gen.token_ids[:1]]), past_key_values=reference,
                         position_ids=torch.tensor([[budget]])).logits[:, -1]
    torch.testing.assert_close(seen[1], expected, rtol=1e-4, atol=1e-4)
