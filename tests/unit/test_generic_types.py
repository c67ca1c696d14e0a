"""The survey: every decoder-only text type of the installed transformers (142 in 5.23), built with `random:<type>`,
either runs or is refused in one line before weights load, naming its group.

For every type that runs (the generic path, `kvbench.models.generic`):
- the full cache generates the same greedy tokens as transformers' own `generate` on the same model;
- a cheap set of methods (full, snapkv, h2o, adakv, streamingllm: a selector, an accumulated-attention evictor, the
  per-head variable storage and a fixed pattern) gives, at the first decode step after compression, the logits of
  the model run over a plain uncompressed cache with **the model's own attention function** (sdpa or its eager
  kernel, its own window/chunk mask included) restricted to the kept positions, and holds exactly the kept entries'
  bytes (layer by layer, per-layer head sizes included).
Every registered method runs that contract on two types that hold every generic kind between them: Gemma 4 (GQA,
sliding/global mix, per-layer head sizes, q/k/v norms) and Llama 4 (chunked + NoPE layers, complex rotary,
MoE, position-scaled queries); the full cross product over ~65 types would cost ~30 x more (~1.5 s per method and
type here) for no new code path: the generic path is per kind, not per type; the cheap set checks every type, and
test_query_form.py each query-norm placement and rotary layout.
The count of types that run is printed (`-s`)."""
from __future__ import annotations

import functools

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicIndexedLayer, DynamicLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvbench.engine.batching import generate
from kvbench.methods.base import Kind
from kvbench.models import AttentionCapture, ModelSpec
from kvbench.models.generic import decoder_types
from kvbench.models.loader import RANDOM_HYBRIDS, RANDOM_LATENT_HYBRIDS, check_architecture
from kvbench.models.tiny import tiny_random_model
from kvbench.registry import METHODS
from kvbench.cache.offloaded import OffloadedLayer
from kvbench.cache.paged import PagedLayer
from kvbench.cache.pq_offloaded import PQOffloadedLayer
from kvbench.cache.quantized import QuantizedLayer
from tests.unit.test_families import RETRIEVING, attended_positions, configured
from tests.unit.tiny import attention_function, prompt

N, BUDGET = 24, 12
CHEAP = ("full", "snapkv", "h2o", "adakv", "streamingllm")
REPRESENTATIVE = ("gemma4_text", "llama4_text")  # every generic kind between them (module doc)

# The spec's groups of the types kvbench refuses (shared/specs/models-transformers-5.23.md, sections 1 and 3), and
# the words their refusal must start with or contain.
REFUSED = {
    "hybrid:": "inkling_text inkling2_text recurrent_gemma "
               "qwen4_exp_text",  # (the other hybrids run: tests/unit/test_hybrid.py)
    "sparse-attention indexer layers (indexer_types) reuse": "hy_v4",  # (the other DSA types run below; the other
    # MLA and sink types: tests/unit/test_sinks_mla.py)
    "AttentionInterface": "cpmant gpt_neo gpt_neox_japanese xglm",  # (bloom, codegen: hand-written rows, run below)
    "no per-token KV cache": "mamba mamba2 falcon_mamba rwkv xlstm",
    "no KV": "gemma4_assistant gemma4_unified_assistant openai-gpt",
    "across layers": "gemma3n_text",
    "compressed KV": "deepseek_v4",
    "twice per layer": "diffllama",
    "mixture-of-attention": "jetmoe",
    "cycle": "hrm_text",
    "dynamic-mask": "doge",
    "cross-attention": "mllama blt",
}
REFUSAL = {t: words for words, types in REFUSED.items() for t in types.split()}
HAND_WRITTEN = {"llama", "mistral", "qwen2", "qwen3", "phi3", "gpt_neox", "gpt2", "gemma3_text", "gemma2", "gptj",
                "falcon", "mpt", "gpt_oss", "deepseek_v3"}  # test_families.py runs every method on these
# Types the config check lets through whose tiny random model does not build or run here, each with the reason; not
# counted as running. None today: kvbench.models.tiny.TYPE_FIELDS sizes the six that used to be here.
NOT_BUILT: dict[str, str] = {}
_models: dict[str, torch.nn.Module] = {}


def model_of(model_type: str) -> torch.nn.Module:
    if model_type not in _models:
        _models[model_type] = tiny_random_model(model_type)
    return _models[model_type]


@functools.cache
def adapter_of(model: torch.nn.Module):
    """The model's adapter, found once per model for the references below (the generic path reads the type's
    modeling source to find it: ~10 ms a call)."""
    from kvbench.models.adapters import adapter_for

    return adapter_for(model)


def generic_types() -> list[str]:
    return [t for t in decoder_types() if t not in REFUSAL and t not in HAND_WRITTEN and t not in NOT_BUILT
            and t not in RANDOM_HYBRIDS + RANDOM_LATENT_HYBRIDS]  # (hybrids: test_hybrid.py, test_linear_hybrids.py)


def test_survey_every_decoder_type_runs_or_is_refused_in_one_line(capsys):
    """Each type's `random:<type>` is checked from its config alone (no weights); a refused one names its group,
    every other one gets an adapter. Prints the count."""
    runs, refused, wrong = [], [], []
    for model_type in decoder_types():
        spec = ModelSpec(name="m", path=f"random:{model_type}")
        try:
            check_architecture(spec)
            runs.append(model_type)
        except ValueError as err:
            refused.append(model_type)
            if REFUSAL.get(model_type) not in str(err) or "\n" in str(err):
                wrong.append(f"{model_type}: {err}")
    assert not wrong and set(refused) == set(REFUSAL), (wrong, set(REFUSAL) - set(refused))
    assert len(decoder_types()) == 142
    running = [t for t in runs if t not in NOT_BUILT]  # each runs the contract below (or test_families.py)
    with capsys.disabled():
        print(f"\nsurvey: {len(running)} of {len(decoder_types())} decoder types run ({len(refused)} refused, "
              f"{len(NOT_BUILT)} pass the check but their tiny model does not build here)")
    assert len(running) >= 110


def first_step(model, method, ids, budget: int = BUDGET) -> tuple[torch.Tensor, list, list, object]:
    """kvbench's logits at the first decode step after compression, the positions each layer attended there (for a
    retrieving layer: what it retrieved at that step, as test_families.py reads it), the layers."""
    seen = {}
    n = ids.shape[1]

    def on_logits(t, logits):
        if t == 0:  # (no cache handed to the capture: nothing compressed, every position kept)
            layers = capture.cache.layers if capture.cache is not None else [None] * model.config.num_hidden_layers
            seen["kept"] = [None if layer is None or isinstance(layer, (*RETRIEVING, QuantizedLayer))  # (KIVI: all)
                            else attended_positions(layer)
                            for layer in layers]
            for layer in layers:
                if isinstance(layer, RETRIEVING):
                    layer.selections = []
            seen["layers"] = list(layers)
        elif t == 1:
            seen["logits"] = logits.clone()

    with AttentionCapture(model, window=getattr(method, "window", 0)) as capture:
        gen = generate(model, None, method, capture, ids, budget, 2, eos_ids=set(), on_logits=on_logits)
    kept = seen["kept"]
    static = torch.cat([torch.arange(4), torch.arange(n - 8, n)])  # sinks + recent (configured())
    for i, layer in enumerate(seen["layers"]):
        if isinstance(layer, OffloadedLayer):
            kept[i] = [torch.cat([static, top]) for top in layer.selections[0][1][0]]
        elif isinstance(layer, PagedLayer) and layer.selections:
            kept[i] = [(pages[:, None] * 8 + torch.arange(8)).flatten() for pages in layer.selections[0][0]]
            kept[i] = [p[p <= n] for p in kept[i]]
        elif isinstance(layer, PQOffloadedLayer):
            kept[i] = [torch.cat([static, top]) for top in layer.selections[0][0]]
    return seen["logits"], kept, seen["layers"], gen


def masked_by_own_attention(model, ids, token, kept) -> torch.Tensor:
    N = ids.shape[1]  # noqa: N806 (the new token's position)
    """One decode step at position N over a plain full-prompt cache through the model's own attention function, with
    -inf on the positions a layer's stored head did not keep and, in a sliding or chunked layer, outside the window
    or chunk its config gives (a plain cache's layers are not sliding, so the model's own mask does not say)."""
    if adapter_of(model).replaces is not None:  # (CodeGen, BLOOM: outside the interface, hand-written rows)
        return masked_by_own_mask(model, ids, token, kept)
    own = ALL_ATTENTION_FUNCTIONS.get_interface(model.config._attn_implementation, None)
    if own is None:  # eager: the type's own eager kernel
        import importlib

        own = importlib.import_module(type(model).__module__).eager_attention_forward

    def masked(module, q, k, v, attention_mask, **kw):
        mask, n_heads = attention_mask, q.shape[1]  # (per layer: dots.llm3's layers differ in head count)
        indices = kw.pop("indices", None)  # DSA: fold the indexer's top-k in, as the model's own sdpa branch does
        if indices is not None:
            chosen = torch.zeros(1, 1, 1, k.shape[2], dtype=torch.bool)
            chosen[0, 0, 0, indices[0, -1].long()] = True
            mask = torch.zeros(chosen.shape) if mask is None else mask[..., : k.shape[2]]
            mask = mask.masked_fill(~chosen, torch.finfo(q.dtype).min)
        per_head = kept[module.layer_idx]
        allowed = torch.zeros(1, n_heads, 1, k.shape[2], dtype=torch.bool)
        for hq in range(n_heads):
            allowed[0, hq, 0, slice(None) if per_head is None else per_head[hq * len(per_head) // n_heads]] = True
        allowed[..., -1] = True  # the new token
        kind = (getattr(model.config, "layer_types", None) or ["full_attention"] * 99)[module.layer_idx]
        position = torch.arange(k.shape[2])
        if kind == "sliding_attention":  # the key is visible while N - position < window
            allowed &= position > N - model.config.sliding_window
        elif kind == "chunked_attention":  # Llama 4: the keys of the query's own chunk
            allowed &= position // model.config.attention_chunk_size == N // model.config.attention_chunk_size
        extra = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
        if mask is not None:
            mask = mask[..., : k.shape[2]]
            mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else mask
        return own(module, q, k, v, extra if mask is None else mask + extra, **kw)

    indexed = [m for m in model.modules() if getattr(m, "indexer", None) is not None and hasattr(m, "layer_idx")]

    def kept_only(module, args, kwargs):  # a DSA layer's indexer, too, ranks only the kept entries (and the new one)
        mask = kwargs["attention_mask"]  # (None under a test attention function: no mask function registered)
        mask = torch.zeros(1, 1, 1, N + 1) if mask is None else mask
        dropped = torch.zeros(mask.shape[-1], dtype=torch.bool)
        if kept[module.layer_idx] is not None:  # (MLA: one latent head, the same entries for every query head)
            dropped[:] = True
            dropped[kept[module.layer_idx][0]] = dropped[-1] = False
        kwargs["attention_mask"] = (mask & ~dropped if mask.dtype == torch.bool
                                    else mask.masked_fill(dropped, torch.finfo(mask.dtype).min))
        return args, kwargs

    reference = DynamicCache()
    if indexed:  # a DSA layer's cache must hold its indexer's keys: its own config's layer, the others plain
        reference = DynamicCache(config=model.config)
        reference.layers = [layer if isinstance(layer, DynamicIndexedLayer) else DynamicLayer()
                            for layer in reference.layers]
    with torch.no_grad():
        model(ids, past_key_values=reference, use_cache=True)
    hooks = [m.register_forward_pre_hook(kept_only, with_kwargs=True) for m in indexed]
    try:
        with attention_function(model, masked):
            return model(token, past_key_values=reference, position_ids=torch.tensor([[N]])).logits[:, -1]
    finally:
        for hook in hooks:
            hook.remove()


def masked_by_own_mask(model, ids, token, kept) -> torch.Tensor:
    """For attention outside the AttentionInterface (CodeGen's `_attn`, BLOOM's `forward`, replaced per instance as
    GPT-J's and MPT's): one decode step over a plain full-prompt cache through transformers' own attention code (BLOOM:
    its ALiBi by slot, which on an uncompressed cache is by position), the positions a head did not keep masked
    through the module's own additive mask argument."""
    from kvbench.models.adapters import adapter_for

    n, heads = ids.shape[1], model.config.num_attention_heads

    def restrict(module, args, kwargs):
        per_head = kept[module.layer_idx]
        dropped = torch.zeros(1, heads, 1, n + 1, dtype=torch.bool)
        if per_head is not None:
            dropped[...] = True
            for hq in range(heads):
                dropped[0, hq, 0, per_head[hq * len(per_head) // heads]] = False
            dropped[..., -1] = False
        kwargs["attention_mask"] = torch.zeros(dropped.shape).masked_fill(dropped, torch.finfo(torch.float32).min)
        return args, kwargs

    with torch.no_grad():
        reference = DynamicCache()
        model(ids, past_key_values=reference, use_cache=True)
    attention = adapter_for(model).attention_class()
    hooks = [m.register_forward_pre_hook(restrict, with_kwargs=True) for m in model.modules()
             if isinstance(m, attention)]
    try:
        with torch.no_grad():
            return model(token, past_key_values=reference, position_ids=torch.tensor([[n]])).logits[:, -1]
    finally:
        for hook in hooks:
            hook.remove()


def window_layers(model) -> frozenset[int]:
    return adapter_of(model).window_layers(model.config)


def indexer_width(layer) -> int:
    keys = getattr(layer, "indexer_keys", None)
    return 0 if keys is None else keys.shape[-1]


def check_contract(model_type: str, name: str) -> None:
    method = configured(name)
    if name == "gear":  # full rank for every layer's head size (Gemma 4's global layers are wider): exact read-back
        from kvbench.models.adapters import adapter_for

        model = model_of(model_type)
        method.rank = max(m.head_dim for m in adapter_for(model).attention_modules(model).values())
    retrieving = name in ("quest", "pqcache", "tailorkv")  # configured() sizes them for test_families.py's prompt
    model, ids = model_of(model_type), prompt(120 if retrieving else N)
    logits, kept, layers, gen = first_step(model, method, ids, 32 if retrieving else BUDGET)
    expected = masked_by_own_attention(model, ids, torch.tensor([gen.token_ids[:1]]), kept)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    if name == "full" or all(i in window_layers(model) for i in range(len(kept))):  # (only window layers)
        assert gen.kv_bytes == gen.full_kv_bytes
    elif method.kind is not Kind.STORAGE:  # bytes held = kept entries x (K + V widths) x 4 (fp32; MLA: latent + rope;
        # DSA: + the indexer's key, evicted with its entry)
        assert gen.kv_bytes == sum(len(p) * (layer.keys.shape[-1] + layer.values.shape[-1] + indexer_width(layer)) * 4
                                   for p_layer, layer in zip(kept, layers) for p in (p_layer or ()))
        assert gen.kv_bytes < gen.full_kv_bytes


@pytest.mark.parametrize("model_type", generic_types())
def test_generic_type_keeps_the_contract(model_type):
    """Full cache = transformers' own greedy generate; the cheap methods = masked dense recompute (module doc)."""
    model, ids = model_of(model_type), prompt(N)
    with torch.no_grad():
        own = model.generate(ids, max_new_tokens=4, do_sample=False, attention_mask=torch.ones_like(ids))
    with AttentionCapture(model) as capture:
        gen = generate(model, None, configured("full"), capture, ids, None, 4, eos_ids=set())
    assert gen.token_ids == own[0, N:].tolist()
    for name in CHEAP:
        check_contract(model_type, name)


def test_dsa_with_sinks_and_an_indexer_in_every_layer_keeps_the_contract():
    """Hunyuan-V4 (MLA + DSA indexer + learned sinks) is refused by default for its "shared" indexer layers; with an
    indexer in every layer it runs the cheap set like the other DSA types."""
    from transformers import AutoModelForCausalLM

    from kvbench.models.tiny import tiny_type_config

    config = tiny_type_config("hy_v4")
    config.indexer_types = ["full"] * config.num_hidden_layers
    torch.manual_seed(0)
    _models["hy_v4 (full indexers)"] = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    for name in CHEAP:
        check_contract("hy_v4 (full indexers)", name)


NEEDS_ROTARY = ("expected_attention", "cap", "duo_attention", "lukv", "kvquant")  # read the layer's rotary


@pytest.mark.parametrize("name", METHODS.names())
@pytest.mark.parametrize("model_type", REPRESENTATIVE)
def test_every_method_on_a_representative_type_of_each_kind(model_type, name):
    """Every method keeps the contract, or (Llama 4, whose NoPE layers scale queries by position, so no rotary form
    is known) refuses in one line."""
    if model_type == "llama4_text" and name in NEEDS_ROTARY:
        with pytest.raises((ValueError, NotImplementedError), match="rotary|no pattern") as err:
            check_contract(model_type, name)
        assert "\n" not in str(err.value)
        return
    check_contract(model_type, name)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "smollm3"])
def test_batch_4_equals_batch_1_on_generic_types(model_type):
    """The engine's batched step (rows shared across samples) gives each sample the records it gets alone."""
    from tests.unit.test_batching import assert_same, batch_one_and_batched

    for name in ("snapkv", "h2o"):
        assert_same(*batch_one_and_batched(model_of(model_type), configured(name), 48, batch_size=4))


@pytest.mark.parametrize("model_type", ["qwen3_moe", "seed_oss"])
def test_position_shift_on_a_generic_type_equals_its_own_rope(model_type):
    """StreamingLLM with positions=shift on a generic type: the next step equals a plain cache holding the kept
    entries with keys re-rotated from position p to slot s by the type's own `apply_rotary_pos_emb`."""
    import importlib

    from kvbench.models.adapters import adapter_for

    n, budget = 120, 32
    model, ids = model_of(model_type), prompt(n)
    method = configured("streamingllm")
    seen = {}
    with AttentionCapture(model) as capture:
        gen = generate(model, None, method, capture, ids, budget, 2, eos_ids=set(), positions="shift",
                       on_logits=lambda t, logits: seen.setdefault(t, logits.clone()))
    keep = torch.cat([torch.arange(method.n_sink), torch.arange(n - (budget - method.n_sink), n)])
    apply_rope = importlib.import_module(type(model).__module__).apply_rotary_pos_emb
    assert adapter_for(model).generic
    with torch.no_grad():
        full = DynamicCache()
        model(ids, past_key_values=full, use_cache=True)
        shifted = []
        for layer in full.layers:
            k, v = layer.keys[:, :, keep], layer.values[:, :, keep]
            cos, sin = model.base_model.rotary_emb(v, (torch.arange(budget) - keep)[None])  # rotate by slot - p
            shifted.append((apply_rope(k, k, cos, sin)[0], v))
        cache = DynamicCache(ddp_cache_data=shifted)
        expected = model(torch.tensor([gen.token_ids[:1]]), past_key_values=cache,
                         position_ids=torch.tensor([[budget]])).logits[:, -1]
    torch.testing.assert_close(seen[1], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model_type", ["smollm3", "ernie4_5", "gemma4_text", "opt"])
def test_position_shift_is_refused_where_it_has_no_meaning_on_generic_types(model_type):
    """NoPE layers (SmolLM3), interleaved rotary (ERNIE 4.5), window layers (Gemma 4), learned positions (OPT)."""
    from kvbench.models.adapters import adapter_for

    with pytest.raises(ValueError, match="positions=shift: .* use positions=original") as err:
        adapter_for(model_of(model_type)).check_shift()
    assert "\n" not in str(err.value)
