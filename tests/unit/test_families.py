"""Every supported decoder family x every registered method, on tiny random models built from each family's
transformers config (kvbench.models.tiny): one decode step after compression equals attention over the
*uncompressed* cache masked, per query head, to the kept original positions plus the new token at position N
(independent of kvbench's cache and capture code); the bytes held are the kept entries times the entry size.
Window layers (Gemma 3) are left whole and attend through the model's own window, which the reference applies
itself. Plus: TailorKV's predicted query per family, position shift with partial rotary, one-line rejections."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, DynamicCache

import kvbench.methods  # noqa: F401
from kvbench.cache import KVCache
from kvbench.cache.offloaded import OffloadedLayer
from kvbench.cache.paged import PagedLayer
from kvbench.cache.pq_offloaded import PQOffloadedLayer
from kvbench.cache.quantized import QuantizedLayer
from kvbench.engine.generation import prefill
from kvbench.engine.batching import generate
from kvbench.methods.base import Kind
from kvbench.methods.latent import latent_refusal
from kvbench.models.mla import is_latent
from kvbench.models import AttentionCapture
from kvbench.models.adapters import BY_FAMILY, adapter_for, check_config, check_model_dir
from kvbench.models.loader import RANDOM_FAMILIES
from kvbench.models.tiny import tiny_config
from kvbench.registry import METHODS
from kvbench.runs.config import CONFIG_DIR
from tests.unit.tiny import attention_function, prompt

N, BUDGET, LAYERS = 120, 32, 3
_models: dict[str, torch.nn.Module] = {}


VARIANTS = {"falcon_grouped": ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2)),  # Falcon-40B layout
            "mistral_sliding": ("mistral", dict(sliding_window=32)),  # a uniform window (Mistral v0.1, Phi-3-mini)
            "phi3_sliding": ("phi3", dict(sliding_window=32))}


def model_of(family: str):
    """A cached tiny model of `family` (or of a VARIANTS entry: a family with other config values)."""
    if family not in _models:
        base, changes = VARIANTS.get(family, (family, {}))
        config = tiny_config(base, layers=LAYERS)
        config.update(changes)
        torch.manual_seed(0)
        attn = "sdpa" if BY_FAMILY[base].sdpa else "eager"
        _models[family] = AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
    return _models[family]


def configured(name: str):
    """The method as its YAML configures it; windows shrunk for tiny budgets, TailorKV without its lossy
    quantized layers (every layer then attends exact fp32 entries: sinks, recent and its retrieved top-k)."""
    cfg = OmegaConf.load(CONFIG_DIR / "method" / f"{name}.yaml")
    if "window" in cfg and cfg.window is not None:
        cfg.window = 8
    if name == "tailorkv":
        cfg.update(start_size=4, recent_size=8, quant_layers=[])
    if name == "kivi":  # a residual above the prompt: nothing quantized, so that the attach path is checked exactly
        cfg.update(residual=128)  # (its lossy storage against the reference: tests/unit/test_quantizer_kivi.py)
    if name == "simlayerkv":  # every layer lazy: a random model's attention is nowhere near a real threshold
        cfg.update(lazy_threshold=0.0)
    if name == "quest":  # pages of 8 (budget 32: 4 of the 16 pages), layer 0 dense
        cfg.update(page_size=8, dense_layers=1)
    if name == "pqcache":  # 4 sinks + 8 recent + 20 retrieved; 16 centroids
        cfg.update(sink_size=4, recent_size=8, bits=4)
    if name in ("dms", "kvzap"):  # thresholds that evict every entry outside the window (dms: -‖k‖ < 0) or about
        cfg.update(threshold=0.0, **({"weights": "random"} if name == "kvzap" else {}))  # half (a random surrogate)
    if "prompt_ids" in cfg:  # kvzip, kvgrad: prompts as token ids of the tiny vocabulary; chunks of 64
        cfg.update(chat_template=False, chunk_size=64, prompt_ids=[[5, 6, 7], [8, 9, 10, 11], [12]])
    if name == "duo_attention":  # every head streams (4 sinks + 8 recent), so that every layer shrinks
        cfg.update(sink_size=4, recent_size=8, head_ratio=1.0)
    if name == "minicache":  # every layer paired, every token retained: the pairs read back exactly (the merge's own
        cfg.update(start_layer=0, retention_ratio=1.0)  # read-back: tests/unit/test_minicache.py)
    if name == "gear":  # a full-rank low-rank part (rank = head_dim) gives the quantization error back: the layer
        cfg.update(group_size=8, rank=16)  # reads back its states (its own read-back: tests/unit/test_gear.py)
    if name == "kvquant":  # keys groups longer than the prompt, values unquantized: the keys go back before RoPE and
        cfg.update(group_size=256, quantize_values=False)  # are rotated again: exact in every family's rotary layout
    return instantiate(cfg)


RETRIEVING = (OffloadedLayer, PagedLayer, PQOffloadedLayer)  # what they attend is chosen at each step
EVERY_TOKEN = ("minicache", "gear", "kvquant")  # store every prompt token, in fewer bytes (as configured())


def attended_positions(layer) -> list[torch.Tensor]:
    """Original positions each stored head holds of the prompt (dense and per-head variable layers)."""
    if getattr(layer, "is_varlen", False):
        flat = layer.flat_positions.split(layer.head_lens.tolist())
        return [torch.cat([f, layer.positions[0, h]]) for h, f in enumerate(flat)]
    return list(layer.positions[0])


def masked_reference(model, ids, token, kept, n_heads):
    """Logits of one decode step at position N over a plain full-prompt cache, each query head restricted to
    `kept[layer][stored head]` (None: every position) and, in a window layer, to the model's window."""

    def masked(module, q, k, v, mask, scaling=None, sliding_window=None, softcap=None, **kw):
        per_head = kept[module.layer_idx]
        allowed = torch.zeros(n_heads, k.shape[2], dtype=torch.bool)
        for hq in range(n_heads):
            allowed[hq, slice(None) if per_head is None else per_head[hq * len(per_head) // n_heads]] = True
        allowed[:, -1] = True  # the new token
        if sliding_window:  # Gemma: a key is visible while q_pos - k_pos < window
            allowed &= torch.arange(k.shape[2]) > k.shape[2] - 1 - sliding_window
        if family_of(model) in OWN_KERNEL:  # the model's own eager kernel (sinks, latents expanded), masked
            additive = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[None, :, None, :]
            return BY_FAMILY[family_of(model)].eager_function()(module, q, k, v, additive, scaling=scaling,
                                                                 sliding_window=sliding_window, **kw)
        k, v = k.repeat_interleave(n_heads // k.shape[1], 1), v.repeat_interleave(n_heads // v.shape[1], 1)
        logits = (q @ k.transpose(-1, -2)) * scaling
        if softcap is not None:  # Gemma 2
            logits = softcap * torch.tanh(logits / softcap)
        out = logits.masked_fill(~allowed[None, :, None, :], float("-inf")).softmax(-1) @ v
        return out.transpose(1, 2).contiguous(), None

    with torch.no_grad():
        reference = DynamicCache()
        model(ids, past_key_values=reference, use_cache=True)
    if BY_FAMILY[family_of(model)].replaces is None:
        with attention_function(model, masked):
            return model(token, past_key_values=reference, position_ids=torch.tensor([[N]])).logits[:, -1]
    return masked_by_module_mask(model, reference, token, kept, n_heads)


def masked_by_module_mask(model, reference, token, kept, n_heads):
    """For attention that bypasses the interface (MPT, GPT-J): transformers' own attention code (MPT's ALiBi by
    slot is the original distance on the uncompressed cache) with dropped keys masked through its own mask argument
    (MPT: boolean, True = masked; GPT-J: additive)."""
    boolean = family_of(model) == "mpt"

    def restrict(module, args, kwargs):
        per_head = kept[module.layer_idx]
        dropped = torch.zeros(1, n_heads, 1, N + 1, dtype=torch.bool)
        if per_head is not None:
            dropped[...] = True
            for hq in range(n_heads):
                dropped[0, hq, 0, per_head[hq * len(per_head) // n_heads]] = False
            dropped[..., -1] = False
        kwargs["attention_mask"] = dropped if boolean else torch.zeros(dropped.shape).masked_fill(
            dropped, torch.finfo(torch.float32).min)
        return args, kwargs

    attention = BY_FAMILY[family_of(model)].attention_class()
    handles = [m.register_forward_pre_hook(restrict, with_kwargs=True) for m in model.modules()
               if isinstance(m, attention)]
    try:
        with torch.no_grad():
            return model(token, past_key_values=reference, position_ids=torch.tensor([[N]])).logits[:, -1]
    finally:
        for handle in handles:
            handle.remove()


OWN_KERNEL = ("gpt_oss", "deepseek_v3")  # references through the model's own attention function
LATENT = ("deepseek_v3",)  # MLA: no q-hat (TailorKV is refused) and no positions=shift


def family_of(model) -> str:
    return adapter_for(model).family


@pytest.mark.parametrize("name", METHODS.names())
@pytest.mark.parametrize("family", RANDOM_FAMILIES)
def test_compress_then_decode_equals_masked_dense_recompute(family, name):
    check_contract(family, name)


@pytest.mark.parametrize("name", ["snapkv", "adakv", "h2o", "tailorkv"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_family_variants_keep_the_contract(variant, name):
    check_contract(variant, name)


def check_contract(family: str, name: str):
    model, ids = model_of(family), prompt(N)
    method = configured(name)
    family = adapter_for(model).family  # (ALiBi and soft cap included: MPT and Gemma 2 run every method)
    if method.own_storage and getattr(model.config, "sliding_window", None) and family in ("mistral", "phi3"):
        with pytest.raises(NotImplementedError, match="cannot apply the model's sliding window"):
            with AttentionCapture(model, window=getattr(method, "window", 0)) as capture:  # (the prompt exceeds it)
                generate(model, None, method, capture, ids, BUDGET, 2, eos_ids=set())
        return
    if method.kind is Kind.RECONSTRUCTOR and not method.scores_inputs and family == "mpt":  # ALiBi: no replay scores
        with pytest.raises(NotImplementedError, match="ALiBi"):
            with AttentionCapture(model) as capture:
                generate(model, None, method, capture, ids, BUDGET, 2, eos_ids=set())
        return
    if latent_refusal(method) and any(is_latent(m) for m in model.modules()):  # MLA: refused in one line
        with pytest.raises(ValueError, match=f"^MLA: method={name} .*; on this model use one of: "):
            with AttentionCapture(model, window=getattr(method, "window", 0)) as capture:
                generate(model, None, method, capture, ids, BUDGET, 2, eos_ids=set())
        return
    seen: dict = {}

    def on_logits(t, logits):
        if t == 0:  # compressed, not yet decoded: what the first decode step will attend
            layers = capture.cache.layers if capture.cache is not None else None
            seen["kept"] = [None] * LAYERS if layers is None else [
                None if isinstance(layer, (*RETRIEVING, QuantizedLayer)) else attended_positions(layer)
                for layer in layers]
            for layer in layers or []:
                if isinstance(layer, RETRIEVING):
                    layer.selections = []
            seen["layers"] = layers
        elif t == 1:
            seen["logits"] = logits.clone()

    with AttentionCapture(model, window=getattr(method, "window", 0)) as capture:
        gen = generate(model, None, method, capture, ids, BUDGET, 2, eos_ids=set(), on_logits=on_logits)
    for module in capture.attention_modules.values():  # nothing of the capture is left on the model
        assert "forward" not in module.__dict__ and not module._forward_pre_hooks
    kept = seen["kept"]
    for i, layer in enumerate(seen["layers"] or []):
        if isinstance(layer, OffloadedLayer):  # sinks + recent + what it retrieved at that step
            static = torch.cat([torch.arange(4), torch.arange(N - 8, N)])
            kept[i] = [torch.cat([static, top]) for top in layer.selections[0][1][0]]
        elif isinstance(layer, PagedLayer) and layer.selections:  # per query head: its pages' positions
            kept[i] = [(pages[:, None] * 8 + torch.arange(8)).flatten() for pages in layer.selections[0][0]]
            kept[i] = [p[p <= N] for p in kept[i]]  # the last page holds the new token (position N)
        elif isinstance(layer, PQOffloadedLayer):  # sinks + what it retrieved at that step + window
            static = torch.cat([torch.arange(4), torch.arange(N - 8, N)])
            kept[i] = [torch.cat([static, top]) for top in layer.selections[0][0]]
    n_heads = model.config.num_attention_heads
    expected = masked_reference(model, ids, torch.tensor([gen.token_ids[:1]]), kept, n_heads)
    torch.testing.assert_close(seen["logits"], expected, rtol=1e-4, atol=1e-4)

    window_layers = BY_FAMILY[family].window_layers(model.config)
    if name == "full":
        assert gen.kv_bytes == gen.full_kv_bytes
        return
    if name == "kivi":  # every token kept (here all in the full-precision residual), window layers untouched
        assert all(isinstance(layer, QuantizedLayer) == (i not in window_layers)
                   for i, layer in enumerate(seen["layers"]))
        return
    compressed = [i for i in range(LAYERS) if i not in window_layers
                  and not (name == "quest" and i < method.dense_layers)  # (Quest's dense layers attend all)
                  and name not in EVERY_TOKEN]  # (they store every token, in fewer bytes)
    for i in compressed:  # every non-window layer really shrank; window layers kept the whole prompt
        assert max(len(p) for p in kept[i]) < N
    for i in window_layers:  # only what the next token can see: the last window - 1 prompt positions
        window = model.config.sliding_window
        assert kept[i] is not None and all(p.tolist() == list(range(N - window + 1, N)) for p in kept[i])
    if method.kind is not Kind.STORAGE:  # bytes held = Σ kept entries x (K + V widths) x 4 bytes (fp32); an MLA
        first = seen["layers"][0]  # entry is one latent + its rotary key for all heads
        entry = (first.keys.shape[-1] + first.values.shape[-1]) * 4
        assert gen.kv_bytes == sum(len(p) for layer in kept for p in layer) * entry


@pytest.mark.parametrize("family", [f for f in RANDOM_FAMILIES if f not in LATENT])
def test_predicted_query_is_the_next_layers_own_query(family):
    """TailorKV's q̂: the adapter's projection (query slice of a fused QKV, Conv1D, per-head layout, q-norm,
    partial rotary) of a hidden state equals the query the attention module itself forms from it."""
    model, ids = model_of(family), prompt(40)
    with AttentionCapture(model) as capture:
        seen = {}
        capture.input_hook = lambda i, hidden, pos: seen.setdefault(i, (hidden, pos))
        with torch.no_grad():
            cache = DynamicCache()
            model(ids, past_key_values=cache, use_cache=True)
            model(ids[:, :1], past_key_values=cache, position_ids=torch.tensor([[40]]), use_cache=True)
        hidden, pos = seen[1]
        target = 2 if capture.can_predict(2) else 1  # Gemma 3: layer 2 rotates with the window frequencies
        if target == 1:
            hidden, pos = seen[1]
        predicted = capture.predict_query(target, hidden, pos)
        attn = capture.attention_modules[target]
    grabbed = {}

    def grab(module, q, k, v, mask, **kw):
        grabbed["q"] = q
        return torch.zeros(q.shape[0], q.shape[2], q.shape[1], q.shape[3]), None

    replaces = BY_FAMILY[family].replaces
    if BY_FAMILY[family].rotary_halves:  # the model's own form of what the adapter handed over repeated (gpt-oss)
        pos = tuple(x[..., :x.shape[-1] // 2] for x in pos)
    if replaces is None:
        with attention_function(model, grab):
            attn(hidden_states=hidden, position_embeddings=pos, attention_mask=None)
    else:  # MPT, GPT-J: the query the (kvbench-routed) attention receives; the masked-recompute test checks
        name, factory = replaces  # that this routing equals transformers' own attention code
        setattr(attn, name, factory(attn, grab))
        try:
            with torch.no_grad():
                attn(hidden_states=hidden, position_ids=torch.tensor([[40]]), position_embeddings=pos,
                     attention_mask=None)
        finally:
            del attn.__dict__[name]
    torch.testing.assert_close(predicted, grabbed["q"])


def rope_families():
    return [f for f in RANDOM_FAMILIES if BY_FAMILY[f].positions == "rope" and not BY_FAMILY[f].has_window_layers
            and BY_FAMILY[f].rotary_layout == "half" and f not in LATENT]


@pytest.mark.parametrize("family", rope_families())
def test_position_shift_equals_keys_rotated_by_the_models_own_rope(family):
    """StreamingLLM with positions=shift: the next step equals a plain cache holding the kept entries with keys
    re-rotated from position p to slot s by the family's own `apply_rotary_pos_emb` (partial rotary included)."""
    import importlib

    model, ids = model_of(family), prompt(N)
    method = configured("streamingllm")
    seen = {}
    with AttentionCapture(model) as capture:
        gen = generate(model, None, method, capture, ids, BUDGET, 2, eos_ids=set(), positions="shift",
                       on_logits=lambda t, logits: seen.setdefault(t, logits.clone()))
    keep = torch.cat([torch.arange(method.n_sink), torch.arange(N - (BUDGET - method.n_sink), N)])
    apply_rope = importlib.import_module(f"transformers.models.{BY_FAMILY[family].modeling}").apply_rotary_pos_emb
    rotary = model.base_model.rotary_emb
    with torch.no_grad():
        full = DynamicCache()
        model(ids, past_key_values=full, use_cache=True)
        shifted = []
        for layer in full.layers:
            k, v = layer.keys[:, :, keep], layer.values[:, :, keep]
            cos, sin = rotary(v, (torch.arange(BUDGET) - keep)[None])  # rotate by slot - p
            k = apply_rope(k, k, cos, sin)[0]
            shifted.append((k, v))
        cache = DynamicCache(ddp_cache_data=shifted)
        token = torch.tensor([gen.token_ids[:1]])
        expected = model(token, past_key_values=cache, position_ids=torch.tensor([[BUDGET]])).logits[:, -1]
    torch.testing.assert_close(seen[1], expected, rtol=1e-4, atol=1e-4)


def test_alibi_shift_is_alibi_over_slots():
    """MPT with positions=shift: the next step equals transformers' own MPT over a plain cache that holds only the
    kept entries (its ALiBi by slot: Keyformer's "New Pos"); positions=original differs from it."""
    model, ids = model_of("mpt"), prompt(N)
    method = configured("streamingllm")
    logits = {}
    for positions in ("shift", "original"):
        with AttentionCapture(model) as capture:
            gen = generate(model, None, method, capture, ids, BUDGET, 2, eos_ids=set(), positions=positions,
                           on_logits=lambda t, out: logits.setdefault((positions, t), out.clone()))
    keep = torch.cat([torch.arange(method.n_sink), torch.arange(N - (BUDGET - method.n_sink), N)])
    with torch.no_grad():
        full = DynamicCache()
        model(ids, past_key_values=full, use_cache=True)
        cache = DynamicCache(ddp_cache_data=[(layer.keys[:, :, keep], layer.values[:, :, keep])
                                             for layer in full.layers])
        expected = model(torch.tensor([gen.token_ids[:1]]), past_key_values=cache).logits[:, -1]
    torch.testing.assert_close(logits["shift", 1], expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(logits["original", 1], expected, rtol=1e-4, atol=1e-4)


def test_alibi_bias_uses_each_kept_keys_original_distance():
    """The bias the MPT forward gives the attention is slope_h x (original key position - query position)."""
    from kvbench.models.alibi import alibi_slopes, mpt_attention_forward

    model, ids = model_of("mpt"), prompt(N)
    masks = []
    with AttentionCapture(model) as capture:
        cache = KVCache()
        token = prefill(model, ids, cache).argmax(-1, keepdim=True)
        keep = torch.tensor([0, 5, 17, 60, 99, N - 1])
        for layer in cache.layers:
            layer.keep(keep.expand(1, layer.keys.shape[1], -1))
        first = capture.attention_modules[0]  # layer 0 records the mask its attention function receives
        first.forward = mpt_attention_forward(
            first, lambda m, q, k, v, mask, **kw: masks.append(mask) or (q.transpose(1, 2), None))
        with torch.no_grad():
            model(token, past_key_values=cache, position_ids=torch.tensor([[N]]))
    slopes = alibi_slopes(4)
    distances = torch.cat([keep, torch.tensor([N])]) - N  # the new token sits at N, at distance 0
    torch.testing.assert_close(masks[0][0, :, 0], slopes[:, None] * distances[None].float())


@pytest.mark.parametrize("family", [f for f in RANDOM_FAMILIES if f not in rope_families() + list(LATENT)
                                    and BY_FAMILY[f].positions != "alibi"])
def test_position_shift_is_refused_where_it_has_no_meaning(family):
    with pytest.raises(ValueError, match="positions=shift: .* use positions=original"):
        BY_FAMILY[family].check_shift()


@pytest.mark.parametrize("config,message", [
    ({"model_type": "t5", "is_encoder_decoder": True}, "encoder-decoder model"),
    ({"model_type": "mamba"}, "state-space/recurrent model"),
    ({"model_type": "bert"}, "has no architecture adapter"),
    ({"model_type": "falcon", "alibi": True}, "falcon .* is not supported: ALiBi Falcon"),
    ({"model_type": "glm_moe_dsa", "num_hidden_layers": 2, "indexer_types": ["full", "shared"]},
     "is not supported yet: MLA: its \"shared\" sparse-attention indexer layers"),  # (DSA itself runs)
])
def test_unsupported_architectures_fail_in_one_line_from_config_json(tmp_path, config, message):
    (tmp_path / "config.json").write_text(json.dumps(config))  # no weights at all: refused from the config alone
    with pytest.raises(ValueError, match=message) as err:
        check_model_dir(tmp_path)
    assert "\n" not in str(err.value) and "supported: llama" in str(err.value)


def test_every_random_family_has_a_supported_adapter():
    for family in RANDOM_FAMILIES:
        model_type = model_of(family).config.model_type
        assert check_config(model_type) is BY_FAMILY[family]


@pytest.mark.parametrize("family", ["gemma2", "mpt"])
def test_scores_see_the_attention_the_model_pays(family):
    """Soft-capping (Gemma 2) and ALiBi (MPT) enter what methods score: the capture's column sums and the window
    attention SnapKV-style methods compute equal transformers' own eager attention weights (global layers)."""
    from kvbench.methods.base import window_attention

    model, ids = model_of(family), prompt(60)
    with torch.no_grad():
        weights = model(ids, output_attentions=True).attentions  # [B, H, n, n] per layer, the model's own
    with AttentionCapture(model, window=8) as capture:
        capture.column_score = lambda logits: logits.softmax(dim=-1)
        cache = KVCache()
        prefill(model, ids, cache)
        for i in range(LAYERS):
            if i in capture.window_layers:
                continue
            torch.testing.assert_close(capture.column_sums[i], weights[i].sum(dim=2), rtol=1e-4, atol=1e-4)
            window = window_attention(capture.window_queries[i], cache.layers[i].keys, capture.scaling[i],
                                      capture.window_bias.get(i), capture.softcap.get(i))
            torch.testing.assert_close(window, weights[i][:, :, -8:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
def test_trimmed_window_layers_decode_like_the_full_cache(family):
    """Window layers keep only the last window - 1 prompt entries after prefill; with the global layers uncompressed
    (budget = prompt) every decode step, as tokens leave the window, equals the full cache's."""
    model, ids = model_of(family), prompt(N)
    logits = {}
    for name, budget in (("full", None), ("snapkv", N)):
        with AttentionCapture(model, window=8) as capture:
            gen = generate(model, None, configured(name), capture, ids, budget, 10, eos_ids=set(),
                           on_logits=lambda t, out: logits.setdefault((name, t), out.clone()))
        if name == "snapkv":
            window = model.config.sliding_window
            assert gen.kept_per_layer == [window - 1.0, float(N), window - 1.0]
            assert gen.kv_bytes < gen.full_kv_bytes
    for t in range(10):
        torch.testing.assert_close(logits["snapkv", t], logits["full", t], rtol=1e-4, atol=1e-4)


def test_decode_scores_see_alibi_once_and_by_original_distance():
    """What a decode-time method scores on MPT is biased by slope_h x (original key position - query position),
    once (the bias is not added again from the attention mask)."""
    from kvbench.models.alibi import alibi_slopes

    model, ids = model_of("mpt"), prompt(N)
    keep = torch.tensor([0, 5, 17, 60, 99, N - 1])
    seen = {}
    with AttentionCapture(model) as capture:
        cache = KVCache()
        token = prefill(model, ids, cache).argmax(-1, keepdim=True)
        for layer in cache.layers:
            layer.keep(keep.expand(1, layer.keys.shape[1], -1))
        capture.cache = cache
        capture.decode_hook = lambda i, query, key, scaling, bias=None: seen.setdefault(i, bias)
        with torch.no_grad():
            model(token, past_key_values=cache, position_ids=torch.tensor([[N]]))
    distances = torch.cat([keep, torch.tensor([N])]) - N
    for i in range(LAYERS):
        torch.testing.assert_close(seen[i][0, :, 0], alibi_slopes(4)[:, None] * distances[None].float())
