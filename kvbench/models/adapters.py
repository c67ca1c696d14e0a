"""One small adapter per decoder family: where its attention lives and how its queries and positions are formed.

The capture (`kvbench.models.capture`) and the position tools (`kvbench.cache.rerotate`) ask the adapter instead of
guessing from attribute names: attention modules are found by the family's own attention class, a layer's query for
another layer's input (TailorKV's q̂) is the family's query projection (separate, or the query slice of a fused
QKV weight) followed by its per-head norm and rotary embedding, and `positions=shift` re-rotates only the rotary
dims. Methods never see an adapter.

Most families route attention through transformers' `AttentionInterface`, so the capture's attention function sees
post-position-encoding queries and keys as they are. MPT, GPT-J and Falcon compute attention themselves; their row
names the attribute the capture replaces on each instance (`replaces`: `kvbench/models/alibi.py`, `gptj.py`,
`falcon.py`), which hands the same q/k/v to the capture's function. Encoder-decoder, state-space and unknown model
types, and variants an adapter refuses from config.json (ALiBi Falcon), fail in one line before weights load
(`check_config`). Every method runs on every family: decode attention over layers with their own storage applies
the family's ALiBi and soft cap itself (`kvbench.attention.decode`).

Window layers (Gemma 2/3, Qwen `sliding_attention`): methods leave them alone and the budget applies to the global
layers; the capture trims them to what the window still shows and applies the window by position at decode
(documented in docs/methods.md's architecture table).
"""
from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from kvbench.models.alibi import bloom_attention_forward, mpt_attention_forward
from kvbench.models.falcon import falcon_attention_forward, falcon_query
from kvbench.models.gptj import gptj_attention_core
from kvbench.models.mla import is_latent


@dataclass(frozen=True)
class Adapter:
    """What kvbench needs to know about one decoder family (data, no behaviour of its own beyond reading it)."""

    family: str
    model_types: tuple[str, ...]
    modeling: str  # transformers module name under transformers.models, e.g. "llama.modeling_llama"
    attention: str  # the family's attention class in that module
    query: str = "q_proj"  # the module producing queries (its own projection or a fused QKV projection)
    query_layout: Literal["own", "leading", "per_head", "split", "gated"] = "own"  # fused: queries first, [q, k, v]
    # per head, or whatever the module's own `_split_heads` does (Falcon's three layouts); gated: [q, gate] per head
    # (Qwen3-Next / Qwen3.5's output gate)
    query_norm: str | None = None  # per-head norm applied to queries before RoPE (Qwen3, Gemma 3)
    query_norm_scope: Literal["head", "projection"] = "head"  # projection: the norm spans all heads (OLMo-hybrid)
    positions: Literal["rope", "learned", "alibi", "none"] = "rope"  # rope: rotated q/k; learned: added once at the
    # embedding; alibi: a per-head bias by distance, from each key's recorded position; none: NoPE attention
    # (Jamba, Nemotron-H: the recurrent layers carry order)
    rotary: str = "rotary_emb"  # the base model's rotary module (inverse frequencies for positions=shift)
    rotary_inv_freq: str = "inv_freq"
    has_window_layers: bool = False  # alternating sliding-window / global layers (config.layer_types)
    softcap: bool = False  # attention logits soft-capped (Gemma 2): scoring and decode attention apply it
    replaces: tuple[str, Callable] | None = None  # (attribute, factory(module, attention function)): for attention
    # that bypasses transformers' AttentionInterface, the capture sets that attribute on each instance (MPT's
    # `forward`, GPT-J's `_attn`) and removes it on exit; None: the interface already routes attention
    rotary_layout: Literal["half", "interleaved"] = "half"  # GPT-J rotates pairs of adjacent dims
    rotary_halves: bool = False  # the model hands over (cos, sin) for one half only and rotates both halves with it
    # (gpt-oss): kvbench repeats them, the "half" layout's usual form
    sdpa: bool = True  # False: transformers refuses sdpa for this family; the loader falls back to eager
    output: str = "o_proj"  # the attention's output projection (W_o), read by value-weighing scorers (CriticalKV)
    output_transposed: bool = False  # its weight is stored [in, out] (GPT-2's Conv1D) rather than nn.Linear's
    refuse: Callable[[dict], str | None] | None = None  # config.json -> a reason to refuse this variant, or None
    mlp: str | None = None  # the family's gated MLP class, computed in place under the capture (`models.mlp`)
    mlp_layout: Literal["gated", "fused"] = "gated"  # gate_proj and up_proj, or Phi-3's fused gate_up_proj
    generic: bool = False  # found by the generic path (`models.generic`): windows from transformers' layer kinds,
    # the query form found from the model's own queries (`models.query_form`)
    nope_layers: bool = False  # some layers have no rotary (SmolLM3, Llama 4, EXAONE 4): positions=shift refused
    query_temperature: bool = False  # queries scaled by a position-dependent factor (Llama 4, Ministral 3)
    chunked_layers: bool = False  # chunked attention (Llama 4): a query sees only its own chunk
    numbered_by_layer: bool = False  # Zamba / Zamba 2: each hybrid layer's attention block is built without its
    # index (layer_idx None / -1; the forward is handed it): numbered by the decoder layer holding it, set on the
    # block while a capture is attached
    query_predictable: bool = True  # False: no other layer's input predicts a layer's queries (ZAYA's also read a
    # convolution over past tokens; Zamba's join the embeddings, with a LoRA per use): TailorKV's q-hat is refused
    own_cache: bool = False  # the base model's forward takes no cache but its own class while `use_cache` is set
    # (MiniMax: `MiniMaxCache`), though its layers use whatever cache is handed over: the capture hands kvbench's over
    # with use_cache off (`capture.hand_cache_over`)
    indexed_layers: bool = False  # DSA (DeepSeek-V3.2): an indexer picks each query's top-k keys
    # (`mla.with_sparse_indices`)

    # --- finding attention ------------------------------------------------------------------------------------
    def attention_class(self) -> type:
        return getattr(importlib.import_module(f"transformers.models.{self.modeling}"), self.attention)

    def attention_modules(self, model: torch.nn.Module) -> dict[int, torch.nn.Module]:
        """{cache slot: attention module} of this family's attention class (vision towers etc. are skipped): a
        module's slot is its rank in layer order, its layer index unless a hybrid's other layers come between
        (`KVCache.slot_of`)."""
        return {slot: m for slot, (_, m) in enumerate(self._numbered(model))}

    def layer_numbers(self, model: torch.nn.Module) -> dict[int, int]:
        """{cache slot: model layer index} of the attention modules (their own `layer_idx` unless
        `numbered_by_layer`)."""
        return {slot: layer for slot, (layer, _) in enumerate(self._numbered(model))}

    def _numbered(self, model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
        cls = self.attention_class()
        if self.numbered_by_layer:
            return [(i, m) for i, layer in enumerate(model.base_model.layers) for m in layer.modules()
                    if isinstance(m, cls)]
        return sorted(((m.layer_idx, m) for m in model.modules() if isinstance(m, cls)), key=lambda p: p[0])

    def output_weight(self, module: torch.nn.Module) -> Tensor:
        """The attention's output projection as `[hidden, H_q * D]` (nn.Linear's layout: column block h is query
        head h's share of W_o)."""
        output = getattr(module, self.output, None)
        if output is None and self.generic:  # the linear child taking the heads' outputs back to the hidden size
            width = module.config.num_attention_heads * _head_dim(module)
            output = [c for c in module.children() if isinstance(c, torch.nn.Linear) and c.in_features == width
                      and c.out_features == module.config.hidden_size][-1]
        weight = output.weight
        return weight.t() if self.output_transposed else weight

    def mlp_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """Every instance of the family's gated MLP class (none for a family without one)."""
        if self.mlp is None:
            return []
        cls = getattr(importlib.import_module(f"transformers.models.{self.modeling}"), self.mlp)
        return [m for m in model.modules() if isinstance(m, cls)]

    def eager_function(self):
        """The family's own eager attention (Gemma 2's applies soft-capping), used under the capture's wrapper;
        exact sdpa for a family whose forward kvbench replaces (its bias arrives as a float mask)."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # ~2.5 s of imports the config checks skip

        module = importlib.import_module(f"transformers.models.{self.modeling}")
        return getattr(module, "eager_attention_forward", None) or ALL_ATTENTION_FUNCTIONS["sdpa"]

    def window_layers(self, config) -> frozenset[int]:
        """Layers with their own sliding window (Gemma 2/3) or chunk (Llama 4), as model layer indices: methods
        leave them to the model's window semantics."""
        if self.generic:
            from kvbench.models.generic import layer_windows

            return frozenset(layer_windows(config))
        types = getattr(config, "layer_types", None) or []
        return frozenset(i for i, t in enumerate(types) if t in ("sliding_attention", "hybrid_sliding"))

    # --- queries and positions --------------------------------------------------------------------------------
    def project_query(self, module: torch.nn.Module, hidden: Tensor) -> Tensor:
        """`module`'s queries for `hidden` `[B, q, hidden]`, before position encoding: `[B, H_q, q, D]`.
        A fused projection is cut to its query rows first, so only the query part is multiplied (Falcon's three
        layouts: the module's own split of the whole projection)."""
        if self.query_layout == "split":
            query = falcon_query(module, hidden)
            return query if self.query_norm is None else getattr(module, self.query_norm)(query)
        proj = getattr(module, self.query)
        head_dim = _head_dim(module)
        n_heads = _n_heads(module, head_dim)
        weight, bias = proj.weight, getattr(proj, "bias", None)
        transposed = type(proj).__name__ == "Conv1D"  # GPT-2's [in, out] weight
        if transposed:
            weight = weight.t()
        if self.query_layout == "leading":
            weight, bias = weight[: n_heads * head_dim], None if bias is None else bias[: n_heads * head_dim]
        elif self.query_layout in ("per_head", "gated"):
            parts = 3 if self.query_layout == "per_head" else 2
            rows = weight.view(n_heads, parts * head_dim, -1)[:, :head_dim].reshape(n_heads * head_dim, -1)
            bias = None if bias is None else bias.view(n_heads, parts * head_dim)[:, :head_dim].reshape(-1)
            weight = rows
        query = F.linear(hidden, weight, bias)
        if self.query_norm is not None and self.query_norm_scope == "projection":
            query = getattr(module, self.query_norm)(query)
        query = query.view(*hidden.shape[:2], n_heads, head_dim)
        if self.query_norm is not None and self.query_norm_scope == "head":
            query = getattr(module, self.query_norm)(query)
        return query.transpose(1, 2)

    def position_embeddings(self, module: torch.nn.Module, kwargs: dict) -> tuple[Tensor, Tensor] | None:
        """The (cos, sin) an attention module rotates with, from its forward's kwargs: the model hands them over
        (`position_embeddings`), or GPT-J's module looks them up in its own sinusoid table by `position_ids`."""
        if self.rotary_layout == "interleaved" and not self.generic:
            ids = kwargs["position_ids"]
            sin, cos = module.embed_positions.to(ids.device)[ids].chunk(2, dim=-1)  # [B, q, rotary_dim / 2] each
            return cos, sin
        embeddings = kwargs.get("position_embeddings")
        if self.rotary_halves and embeddings is not None:
            return tuple(torch.cat([x, x], dim=-1) for x in embeddings)
        return embeddings

    def position_query(self, query: Tensor, position_embeddings: tuple[Tensor, Tensor] | None) -> Tensor:
        """Apply the family's position encoding to queries `[B, H_q, q, D]` (rotate the first rotary dims: halves
        swapped, or adjacent pairs for GPT-J's interleaved layout). No (cos, sin) handed over: a NoPE layer."""
        if self.positions != "rope" or position_embeddings is None:
            return query
        cos, sin = (x.unsqueeze(1) for x in position_embeddings)
        if self.rotary_layout == "interleaved":
            cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
        rot = cos.shape[-1]
        head, tail = query[..., :rot], query[..., rot:]
        if self.rotary_layout == "interleaved":
            rotated = torch.stack([-head[..., 1::2], head[..., ::2]], dim=-1).flatten(-2)
        else:
            rotated = torch.cat([-head[..., rot // 2:], head[..., :rot // 2]], dim=-1)
        return torch.cat([head * cos + rotated * sin, tail], dim=-1)

    def check_shift(self) -> None:
        """Raise (one line) if `positions=shift` has no meaning for this family."""
        if self.positions in ("learned", "none"):
            raise ValueError(f"positions=shift: {self.family} has {self.positions} positions, no rotary keys to "
                             "re-rotate; use positions=original")
        if self.rotary_layout != "half":
            raise ValueError(f"positions=shift: re-rotating {self.family}'s interleaved rotary keys is not "
                             "implemented; use positions=original")
        if self.nope_layers:
            raise ValueError(f"positions=shift: {self.family} has NoPE layers (no rotary) beside rotary ones, whose "
                             "keys must not be re-rotated; use positions=original")
        if self.has_window_layers:
            raise ValueError(f"positions=shift: {self.family} mixes sliding-window and global layers, whose slots "
                             "would disagree; use positions=original")

    def inv_freq(self, model: torch.nn.Module) -> Tensor:
        """Rotary inverse frequencies `[rotary_dim / 2]` shared by all layers (positions=shift). ALiBi has no
        rotary dims: shifting only relabels positions as slots, and the bias follows them."""
        self.check_shift()
        if any(is_latent(m) for m in self.attention_modules(model).values()):
            raise ValueError("MLA: positions=shift re-rotates cached keys, and an MLA cache holds latents beside a "
                             "shared rotary key the model rotates itself; use positions=original")
        if self.window_layers(model.config):  # e.g. Qwen2/Qwen3 with use_sliding_window
            raise ValueError(f"positions=shift: this {self.family} model mixes sliding-window and global layers; "
                             "use positions=original")
        if self.positions == "alibi":
            return torch.empty(0)
        rotary = getattr(model.base_model, self.rotary, None)
        if rotary is None or getattr(rotary, "attention_scaling", 1.0) != 1.0:
            raise ValueError(f"positions=shift needs plain rotary embeddings; {self.family} has scaled or no RoPE")
        if not hasattr(rotary, self.rotary_inv_freq):  # (ZAYA: frequencies per layer type, `hybrid_inv_freq`)
            raise ValueError(f"positions=shift: {self.family}'s rotary embedding has no single "
                             f"`{self.rotary_inv_freq}` (its frequencies are kept per layer type); use "
                             "positions=original")
        return getattr(rotary, self.rotary_inv_freq)


def _head_dim(module) -> int:
    return getattr(module, "head_dim", None) or module.head_size


def _n_heads(module, head_dim: int) -> int:
    config = getattr(module, "config", None)
    heads = getattr(config, "num_attention_heads", None) or getattr(module, "num_heads", None) or getattr(
        module, "n_heads", None)
    return heads or module.embed_dim // head_dim


def _interface(family, model_types, modeling, attention, **kw) -> Adapter:
    return Adapter(family, tuple(model_types), modeling, attention, **kw)


ADAPTERS: tuple[Adapter, ...] = (
    _interface("llama", ["llama"], "llama.modeling_llama", "LlamaAttention", mlp="LlamaMLP"),
    _interface("mistral", ["mistral"], "mistral.modeling_mistral", "MistralAttention", mlp="MistralMLP"),
    _interface("qwen2", ["qwen2"], "qwen2.modeling_qwen2", "Qwen2Attention", mlp="Qwen2MLP"),
    _interface("qwen3", ["qwen3"], "qwen3.modeling_qwen3", "Qwen3Attention", query_norm="q_norm", mlp="Qwen3MLP"),
    _interface("phi3", ["phi3"], "phi3.modeling_phi3", "Phi3Attention", query="qkv_proj", query_layout="leading",
               mlp="Phi3MLP", mlp_layout="fused"),
    _interface("gpt_neox", ["gpt_neox"], "gpt_neox.modeling_gpt_neox", "GPTNeoXAttention",
               query="query_key_value", query_layout="per_head", output="dense"),
    _interface("gpt2", ["gpt2"], "gpt2.modeling_gpt2", "GPT2Attention", query="c_attn", query_layout="leading",
               positions="learned", output="c_proj", output_transposed=True),
    _interface("gemma3", ["gemma3_text"], "gemma3.modeling_gemma3", "Gemma3Attention", query_norm="q_norm",
               rotary_inv_freq="full_attention_inv_freq", has_window_layers=True, mlp="Gemma3MLP"),
    _interface("gemma2", ["gemma2"], "gemma2.modeling_gemma2", "Gemma2Attention", sdpa=False, has_window_layers=True,
               softcap=True, mlp="Gemma2MLP"),
    _interface("gptj", ["gptj"], "gptj.modeling_gptj", "GPTJAttention", rotary_layout="interleaved",
               replaces=("_attn", gptj_attention_core), sdpa=False, output="out_proj"),
    _interface("bloom", ["bloom"], "bloom.modeling_bloom", "BloomAttention", query="query_key_value",
               query_layout="per_head", positions="alibi", replaces=("forward", bloom_attention_forward), sdpa=False,
               output="dense"),
    _interface("codegen", ["codegen"], "codegen.modeling_codegen", "CodeGenAttention", rotary_layout="interleaved",
               replaces=("_attn", gptj_attention_core), sdpa=False, output="out_proj"),  # (GPT-J's attention core)
    _interface("falcon", ["falcon"], "falcon.modeling_falcon", "FalconAttention", query="query_key_value",
               query_layout="split", replaces=("forward", falcon_attention_forward), output="dense",
               refuse=lambda c: "ALiBi Falcon (alibi: true, falcon-rw) has no kvbench attention path yet"
               if c.get("alibi") else None),
    _interface("mpt", ["mpt"], "mpt.modeling_mpt", "MptAttention", query="Wqkv", query_layout="leading",
               positions="alibi", replaces=("forward", mpt_attention_forward), sdpa=False, output="out_proj"),
    # learned attention sinks (s_aux, read from each call: kvbench.attention.sinks) and MLA latent caches
    # (kvbench.models.mla); rows until the generic path finds them
    _interface("gpt_oss", ["gpt_oss"], "gpt_oss.modeling_gpt_oss", "GptOssAttention", sdpa=False,
               has_window_layers=True, rotary_halves=True),
    _interface("deepseek_v3", ["deepseek_v3"], "deepseek_v3.modeling_deepseek_v3", "DeepseekV3Attention"),
)
# Hybrids: attention layers beside linear attention / Mamba / short-conv layers, whose state the cache keeps as
# transformers does (`kvbench.cache.hybrid`); methods compress the attention layers only.
HYBRID_ADAPTERS: tuple[Adapter, ...] = (
    _interface("qwen3_next", ["qwen3_next"], "qwen3_next.modeling_qwen3_next", "Qwen3NextAttention",
               query_layout="gated", query_norm="q_norm"),
    _interface("qwen3_5", ["qwen3_5_text"], "qwen3_5.modeling_qwen3_5", "Qwen3_5Attention", query_layout="gated",
               query_norm="q_norm"),
    _interface("qwen3_5_moe", ["qwen3_5_moe_text"], "qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeAttention",
               query_layout="gated", query_norm="q_norm"),
    _interface("olmo_hybrid", ["olmo_hybrid"], "olmo_hybrid.modeling_olmo_hybrid", "OlmoHybridAttention",
               query_norm="q_norm", query_norm_scope="projection"),
    _interface("jamba", ["jamba"], "jamba.modeling_jamba", "JambaAttention", positions="none"),
    _interface("bamba", ["bamba"], "bamba.modeling_bamba", "BambaAttention"),
    _interface("granitemoehybrid", ["granitemoehybrid"], "granitemoehybrid.modeling_granitemoehybrid",
               "GraniteMoeHybridAttention"),  # RoPE optional: a NoPE config hands no (cos, sin) over
    _interface("falcon_h1", ["falcon_h1"], "falcon_h1.modeling_falcon_h1", "FalconH1Attention"),
    _interface("lfm2", ["lfm2"], "lfm2.modeling_lfm2", "Lfm2Attention", query_norm="q_layernorm",
               output="out_proj"),
    _interface("lfm2_moe", ["lfm2_moe"], "lfm2_moe.modeling_lfm2_moe", "Lfm2MoeAttention",
               query_norm="q_layernorm", output="out_proj"),
    _interface("lfm3", ["lfm3"], "lfm3.modeling_lfm3", "Lfm3Attention", query_norm="q_norm",
               has_window_layers=True),  # (its output gate acts after attention: no effect on what is cached)
    _interface("zaya", ["zaya"], "zaya.modeling_zaya", "ZayaAttention", query="qkv_proj", query_predictable=False),
    _interface("zamba", ["zamba"], "zamba.modeling_zamba", "ZambaAttention", numbered_by_layer=True,
               positions="none", query_predictable=False),  # (NoPE; its attention input joins the embeddings)
    _interface("zamba2", ["zamba2"], "zamba2.modeling_zamba2", "Zamba2Attention", numbered_by_layer=True,
               query_predictable=False),  # (its attention input joins the embeddings; a LoRA per use of the block)
    _interface("minimax", ["minimax"], "minimax.modeling_minimax", "MiniMaxAttention", own_cache=True),  # (its
    # lightning layers' state: `get_linear_cache` / `set_linear_cache`, `kvbench.cache.hybrid`)
    _interface("kimi_linear", ["kimi_linear"], "kimi_linear.modeling_kimi_linear", "KimiLinearAttention",
               positions="none"),  # (MLA without rotary: its "rope" key part is shared but never rotated)
    _interface("bailing_hybrid", ["bailing_hybrid"], "bailing_hybrid.modeling_bailing_hybrid",
               "BailingHybridAttention", rotary_layout="interleaved"),  # (Ling 3: KDA + MLA; its output gate acts
    # after attention: no effect on what is cached)
    _interface("nemotron_h", ["nemotron_h"], "nemotron_h.modeling_nemotron_h", "NemotronHAttention",
               positions="none"),
)
ADAPTERS = ADAPTERS + HYBRID_ADAPTERS
BY_MODEL_TYPE = {t: a for a in ADAPTERS for t in a.model_types}
BY_FAMILY = {a.family: a for a in ADAPTERS}


def supported() -> str:
    return (", ".join(t for a in ADAPTERS for t in a.model_types) + ", and any decoder whose attention goes through "
            "transformers' AttentionInterface (docs/methods.md, architecture table)")


def check_config(model_type: str | None, is_encoder_decoder: bool = False, config=None) -> Adapter:
    """The adapter for `model_type`, or a one-line ValueError naming what is missing (call before weights load).
    `config` (the config.json fields, or a config object) lets an adapter refuse a variant of its family (ALiBi
    Falcon), and the generic path find a type's layer kinds (`kvbench.models.generic`)."""
    if is_encoder_decoder:
        raise ValueError(f"model: model_type {model_type!r} is an encoder-decoder model; kvbench compresses "
                         f"decoder-only self-attention caches (supported: {supported()})")
    fields = config.to_dict() if hasattr(config, "to_dict") else config
    adapter = BY_MODEL_TYPE.get(model_type)
    if adapter is None:
        return _generic(model_type, config)
    missing = adapter.refuse(fields) if adapter.refuse and fields is not None else None
    if missing:
        raise ValueError(f"model: {adapter.family} (model_type {model_type!r}) is not supported: {missing} "
                         f"(supported: {supported()})")
    return adapter


def _generic(model_type: str | None, config) -> Adapter:
    """A type without a hand-written row: its composite wrapper's text decoder, a refusal naming its group, or the
    generic path's adapter (`kvbench.models.generic`)."""
    from kvbench.models.generic import causal_lm_types, config_object, generic_fields, generic_refusal, text_config
    from kvbench.models.groups import COMPOSITE, NO_KV, NOT_DECODER_LM, TEXT_CONFIG_TYPES, group_refusal

    model_type = TEXT_CONFIG_TYPES.get(model_type, model_type)  # (Emu3ForCausalLM's config is emu3_text_model)
    if model_type in COMPOSITE:  # a vision-language checkpoint: kvbench runs its text decoder
        text = text_config(config if hasattr(config, "to_dict") else config_object(model_type, config))
        return check_config(text.model_type, False, text)
    if model_type in NO_KV:
        raise ValueError(f"model: model_type {model_type!r} cannot be compressed: {NO_KV[model_type]} "
                         f"(supported: {supported()})")
    if model_type not in causal_lm_types() or model_type in NOT_DECODER_LM:
        raise ValueError(f"model: model_type {model_type!r} has no architecture adapter in kvbench/models/adapters.py "
                         f"and is not a decoder-only text model transformers knows (supported: {supported()})")
    reason = group_refusal(model_type)  # the survey's table decides without a config
    if reason is not None:
        raise ValueError(f"model: model_type {model_type!r} is not supported yet: {reason} (supported: {supported()})")
    try:
        obj = config if hasattr(config, "to_dict") else config_object(model_type, config)
    except Exception as e:  # noqa: BLE001 (transformers' validators raise their own error classes)
        raise ValueError(f"model: model_type {model_type!r}: transformers cannot read its config "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    reason = generic_refusal(model_type, obj)
    if reason is not None:
        raise ValueError(f"model: model_type {model_type!r} is not supported yet: {reason} (supported: {supported()})")
    return Adapter(**generic_fields(model_type, obj))


def adapter_for(model: torch.nn.Module) -> Adapter:
    """The adapter of a loaded model (its config's model_type)."""
    config = model.config
    return check_config(getattr(config, "model_type", None), bool(getattr(config, "is_encoder_decoder", False)),
                        config)


def check_model_dir(path: str | Path) -> Adapter | None:
    """Read a local checkpoint's config.json (no weights) and check its architecture; None if there is none."""
    config = Path(path).expanduser() / "config.json"
    if not config.is_file():
        return None
    data = json.loads(config.read_text())
    return check_config(data.get("model_type"), bool(data.get("is_encoder_decoder", False)), data)
