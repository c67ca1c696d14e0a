"""Tiny random-weight configs of every supported family (no download): for `random:<family>` smoke runs and tests.

Each is hidden 64 with 4 query heads (2 KV heads where the family has GQA); the family's own quirks stay on at tiny
scale so tests exercise them: Phi-3, GPT-NeoX and GPT-J rotate only part of each head (partial rotary; GPT-J
interleaved), Gemma 2/3 alternate a sliding-window layer (window 32) with a global one (Gemma 2 also soft-caps its
logits), GPT-2 adds learned absolute positions at the embedding, MPT biases scores by ALiBi distance, Falcon is
multi-query, gpt-oss adds learned sinks beside a window-32 and a global layer, DeepSeek-V3 caches an MLA latent (32
wide, wider than a head's 16-wide key, so scores cannot silently mix the two up).

Any other model type of the installed transformers (`random:<model_type>`) is built from transformers' own config class
(`tiny_type_config`): its defaults at tiny sizes, one layer of each kind its `layer_types` lists (a window or chunk
of 8 where layers mix them), 4 experts, small MLA ranks (a 32-wide latent); every per-layer list of the config is
cut to those layers. A config those rules cannot size (nested sub-configs, per-layer head counts, rope keyed by
layer type, a multimodal model's towers, widths under names of their own) gets its fields by hand in `TYPE_FIELDS`;
hybrids are sized in `HYBRID_TINY`.
A DSA indexer keeps its top 8 keys (so over a 24-token prompt it really chooses) with 8 heads: its score is a weighted
sum of ReLU'd head scores, exactly 0 for a key every head scores below 0, and with 2 heads such ties fell at the top-k
cut, where the model's own choice among tied keys is arbitrary.
"""
from __future__ import annotations

import torch

BY_FAMILY_NAMES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gpt_neox", "gpt2", "gemma3", "gemma2", "mpt", "gptj",
                   "falcon", "gpt_oss", "deepseek_v3")  # the hand-written families' tiny configs (`tiny_config`)
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def tiny_config(family: str, vocab_size: int = 256, layers: int = 2, max_positions: int = 4096,
                bos_token_id: int | None = None, eos_token_id: int | None = None):
    """A transformers config of `family` at tiny scale."""
    from transformers import AutoConfig

    ids = dict(bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=None, tie_word_embeddings=True)
    common = dict(vocab_size=vocab_size, num_hidden_layers=layers, max_position_embeddings=max_positions, **ids)
    if family == "gpt2":
        return AutoConfig.for_model("gpt2", vocab_size=vocab_size, n_embd=64, n_head=4, n_layer=layers,
                                    n_positions=max_positions, **ids)
    if family == "mpt":  # ALiBi, multi-head, no position embedding at all
        return AutoConfig.for_model("mpt", vocab_size=vocab_size, d_model=64, n_heads=4, n_layers=layers,
                                    expansion_ratio=2, max_seq_len=max_positions, **ids)
    if family == "gptj":  # interleaved rotary on half of each head (GPT-J-6B: 64 of 256)
        return AutoConfig.for_model("gptj", vocab_size=vocab_size, n_embd=64, n_head=4, n_layer=layers, rotary_dim=8,
                                    n_positions=max_positions, **ids)
    if family == "falcon":  # Falcon-7B's layout: multi-query (one KV head), parallel attention, rotary
        return AutoConfig.for_model("falcon", hidden_size=64, num_attention_heads=4, **common)
    if family == "gpt_neox":  # multi-head, rotary on a quarter of each head (rotary_pct 0.25, like Pythia)
        return AutoConfig.for_model("gpt_neox", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                    rotary_pct=0.25, **common)
    kwargs = dict(TINY, **common)
    if family == "gpt_oss":  # learned sinks, a sliding (window 32) and a global layer, 4 experts
        pattern = ["sliding_attention", "full_attention"] * layers
        kwargs.update(sliding_window=32, layer_types=pattern[:layers], num_local_experts=4, num_experts_per_tok=2)
    if family == "deepseek_v3":  # MLA: a 32-wide latent (not the 16-wide per-head key), rope 8
        kwargs.update(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8,
                      qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                      first_k_dense_replace=1, moe_intermediate_size=32, n_group=1, topk_group=1)
        kwargs.pop("head_dim")
    if family == "phi3":
        kwargs.update(partial_rotary_factor=0.5)
    if family == "mistral":
        kwargs.update(sliding_window=None)
    if family in ("gemma3", "gemma2"):
        pattern = ["sliding_attention", "full_attention"] * layers
        kwargs.update(sliding_window=32, query_pre_attn_scalar=16, layer_types=pattern[:layers])
    if family == "gemma2":  # a soft cap that bites at tiny scale, where logits stay below 0.2 (Gemma 2 itself: 50)
        kwargs.update(attn_logit_softcapping=0.05)
    model_type = {"gemma3": "gemma3_text"}.get(family, family)
    return AutoConfig.for_model(model_type, **kwargs)


# Hybrids (by model_type): one recurrent layer on each side of one attention layer (Falcon-H1: both in every layer;
# Nemotron-H: and an MLP-only layer), so a test sees state before and after the attention it compresses.
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=1,
               mamba_chunk_size=16)
_DELTANET = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                 linear_conv_kernel_dim=4)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
_AROUND = ["linear_attention", "full_attention", "linear_attention"]
HYBRID_TINY = {
    "qwen3_next": dict(layer_types=_AROUND, **_DELTANET, **_MOE, shared_expert_intermediate_size=32),
    "qwen3_5_text": dict(layer_types=_AROUND, **_DELTANET),
    "qwen3_5_moe_text": dict(layer_types=_AROUND, **_DELTANET, **_MOE, shared_expert_intermediate_size=32),
    "olmo_hybrid": dict(layer_types=_AROUND, **_DELTANET),
    "jamba": dict(attn_layer_period=3, attn_layer_offset=1, expert_layer_period=3, expert_layer_offset=2,
                  num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=1,
                  mamba_dt_rank=8, head_dim=None),
    "bamba": dict(attn_layer_indices=[1], **_MAMBA2, head_dim=None),
    "granitemoehybrid": dict(layers_block_type=["mamba", "attention", "mamba"], **_MAMBA2, num_local_experts=4,
                             num_experts_per_tok=2, shared_intermediate_size=64, head_dim=None),
    "falcon_h1": dict(mamba_d_ssm=64, **_MAMBA2, layers=2),
    "lfm2": dict(layer_types=["conv", "full_attention", "conv"], conv_L_cache=3, head_dim=None),
    "lfm3": dict(layer_types=["conv", "sliding_attention", "full_attention", "conv"], conv_L_cache=3, sliding_window=64,
                 layers=4),  # (a window of 64 bites in the tests' 120-token prompts)
    "lfm2_moe": dict(layer_types=["conv", "full_attention", "conv"], conv_L_cache=3, num_dense_layers=1, **_MOE,
                     head_dim=None),
    # ZAYA: CCA attention in every layer (q/k mix a conv state, values a delayed one, beside K/V), all global as its
    # default; top-1 routing (the only one it supports)
    "zaya": dict(layer_types=["hybrid", "hybrid"], num_experts=4, num_experts_per_tok=1, moe_intermediate_size=32,
                 router_hidden_size=16, layers=2),
    "zamba": dict(layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid"], n_mamba_heads=2,
                  mamba_d_state=8, mamba_expand=1, mamba_dt_rank=8, num_key_value_heads=4, head_dim=None, layers=4),
    "zamba2": dict(layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], num_mem_blocks=1, mamba_d_state=8,
                   n_mamba_heads=4, mamba_expand=1, mamba_ngroups=1, chunk_size=16,
                   use_shared_attention_adapter=True, adapter_rank=4, use_mem_rope=True, num_key_value_heads=4,
                   head_dim=None, layers=4),
    # (Zamba / Zamba 2: an attention block per hybrid layer without its index, tied across layers in a checkpoint;
    # Zamba 2 with rotary and a LoRA per use)
    # MiniMax: lightning attention in blocks of 16 (a 120-token prompt crosses several), 4 experts
    "minimax": dict(layer_types=_AROUND, block_size=16, num_local_experts=4, num_experts_per_tok=2),
    # Kimi Linear: KDA (delta-rule) layers around an MLA layer (a 32-wide latent, NoPE: nothing rotated), 4 experts
    "kimi_linear": dict(layer_types=_AROUND, mlp_layer_types=["dense", "sparse", "sparse"], kv_lora_rank=32,
                        q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, num_key_value_heads=4,
                        linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=4, num_local_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=32, head_dim=None),
    # Ling 3 (bailing_hybrid): the same around an MLA layer with interleaved rotary (8 of each 16-wide key) and a
    # per-head output gate; its KDA layers' heads are `head_dim` wide
    "bailing_hybrid": dict(layer_types=_AROUND, mlp_layer_types=["dense", "sparse", "sparse"], kv_lora_rank=32,
                           qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, num_key_value_heads=4, head_dim=8,
                           num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=1,
                           topk_group=1, first_k_dense_replace=1),
    "nemotron_h": dict(hybrid_override_pattern="M*-M", ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=16,
                       n_groups=1, conv_kernel=4, expand=1, chunk_size=16, layers=4),
}


def hybrid_config(model_type: str, common: dict):
    """A tiny hybrid of `model_type` (a HYBRID_TINY entry); its layer count is the entry's, not the caller's."""
    from transformers import AutoConfig

    fields = dict(HYBRID_TINY[model_type])
    layers = fields.pop("layers", 3)
    kwargs = dict(TINY, **common, **fields)
    kwargs["num_hidden_layers"] = layers
    kwargs.update(initializer_range=0.2, tie_word_embeddings=False)  # (at 0.02 with tied embeddings a tiny hybrid
    # repeats one token, and a generation equal to transformers' would show little)
    if kwargs["head_dim"] is None:  # (a config class without the field)
        del kwargs["head_dim"]
    return AutoConfig.for_model(model_type, **kwargs)


SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
             shared_expert_intermediate_size=32, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
             qk_nope_head_dim=8, v_head_dim=16, global_head_dim=32, n_group=1, topk_group=1, first_k_dense_replace=0,
             index_topk=8, index_head_dim=16, index_n_heads=8)
WINDOW = 8  # sliding window / attention chunk of the tiny models where layers mix window and global attention
# Types whose config the generic shrinking cannot size (nested sub-configs, fields left None, per-layer head counts,
# rope parameters keyed by layer type): their fields, given by hand and applied last.
_ROPE = dict(rope_type="default", rope_theta=10000.0)
TYPE_FIELDS = {
    "dbrx": dict(d_model=64, n_heads=4, attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),  # (as
                 ffn_config=dict(ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2)),  # DBRX on the Hub)
    "dots1": dict(n_shared_experts=1),
    "phi4_multimodal": dict(  # (its own causal LM holds the vision and audio towers: shrunk so it builds in ~1 s)
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, crop_size=28, patch_size=14),
        audio_config=dict(hidden_size=32, intermediate_size=64, num_blocks=1, num_attention_heads=2,
                          ext_pw_out_channel=32, depthwise_separable_out_channel=32, nemo_conv_channels=32)),
    "laguna": dict(num_attention_heads_per_layer=[4, 8]),  # (real checkpoints vary the query heads by layer)
    "cohere_compass_text": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW,  # (North:
                                rope_parameters=dict(sliding_attention=dict(_ROPE, mrope_section=[4, 2, 2]),  # rotary
                                                     full_attention=None)),  # window layers, NoPE global ones)
    # Widths under names of their own (GPT-2-style n_embd/n_head, CTRL's dff, LongCat's FFN sizes), which SMALL does
    # not reach: at their defaults CodeGen's "tiny" model had 405M parameters (1.6 GB, ~20 s of a test run)
    "codegen": dict(n_embd=64, n_head=4, rotary_dim=8),  # (interleaved rotary on half of each head, as tiny GPT-J)
    "ctrl": dict(n_embd=64, n_head=4, dff=128),
    "gpt-sw3": dict(n_embd=64, n_head=4),
    "gpt_bigcode": dict(n_embd=64, n_head=4),
    "longcat_flash": dict(ffn_hidden_size=128, expert_ffn_hidden_size=32, moe_topk=2),
    "gemma4_text": dict(hidden_size_per_layer_input=16),  # (its per-layer input table: vocabulary x layers x this)
}


def tiny_type_config(model_type: str, vocab_size: int = 256, max_positions: int = 4096,
                     bos_token_id: int | None = None, eos_token_id: int | None = None):
    """A config of any decoder `model_type` at tiny scale, from transformers' own config class (see module doc)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type in HYBRID_TINY:  # (sized by hand: one attention layer between recurrent ones)
        return hybrid_config(model_type, dict(vocab_size=vocab_size, max_position_embeddings=max_positions,
                                              bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                                              pad_token_id=None))
    cls = CONFIG_MAPPING[model_type]
    default = cls()
    if default.get_text_config(decoder=True) is not default:  # composite: its text decoder's own type
        return tiny_type_config(default.get_text_config(decoder=True).model_type, vocab_size, max_positions,
                                bos_token_id, eos_token_id)
    layers = default.num_hidden_layers
    kinds = list(getattr(default, "layer_types", None) or [])
    per_layer = {k: v for k, v in vars(default).items()  # layer_types, no_rope_layers: few values, each a kind
                 if isinstance(v, list) and len(v) == layers and not k.startswith("_") and len(set(map(repr, v))) <= 3}
    rows = [tuple(repr(v[i]) for v in per_layer.values()) for i in range(layers)]
    picked = [rows.index(r) for r in dict.fromkeys(rows)]  # one layer of each kind (a NoPE layer is a kind too)
    picked = picked if len(picked) > 1 else [0, 1]
    fields = {k: [v[i] for i in picked] for k, v in per_layer.items()}
    known = set(vars(default)) | set(getattr(type(default), "__dataclass_fields__", ()))
    fields.update({k: v for k, v in SMALL.items() if k in known})
    if "kv_lora_rank" in fields:  # MLA: a latent wider than a head's key (16, so scores cannot mix them up), every
        fields.update(kv_lora_rank=32, num_key_value_heads=SMALL["num_attention_heads"])  # head reads it, and the
        if "head_dim" in fields:  # rotary tables sized by head_dim cover the rotary part (DeepSeek-V2, YoutU)
            fields["head_dim"] = SMALL["qk_rope_head_dim"]
    mixed = len(set(kinds) & {"sliding_attention", "chunked_attention"}) > 0 and len(set(kinds)) > 1
    for key in ("sliding_window", "attention_chunk_size"):  # a window that bites in a short prompt where layers mix
        if key in known and mixed:
            fields[key] = WINDOW
    fields.update(vocab_size=vocab_size, num_hidden_layers=len(picked), max_position_embeddings=max_positions)
    if "vocab_size_per_layer_input" in known:  # Gemma 4's per-layer input table follows the vocabulary (default 262144)
        fields["vocab_size_per_layer_input"] = vocab_size
    for key, value in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id), ("pad_token_id", None)):
        if value is None:  # keep a default id the tiny vocabulary holds (some configs require an int)
            value = vars(default).get(key)
            value = value if value is None or isinstance(value, int) and value < vocab_size else 0
        fields[key] = value
    fields = {k: v for k, v in fields.items() if k in known or k in ("num_hidden_layers", "vocab_size")}
    fields.update(TYPE_FIELDS.get(model_type, {}))
    return cls(**fields)


def tiny_random_model(family: str, vocab_size: int = 256, layers: int = 2, seed: int = 0, dtype=torch.float32,
                      attn: str = "sdpa", **config):
    """A tiny random model of `family` in eval mode (eager where the family refuses sdpa)."""
    from transformers import AutoModelForCausalLM

    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if family in BY_FAMILY_NAMES:
        config = tiny_config(family, vocab_size, layers, **config)
    else:  # any other model type (random:<model_type>), runnable by kvbench or not (the loader refuses those)
        config = tiny_type_config(family, vocab_size, **config)
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type) or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family]
    causal_lm = getattr(transformers, name)  # (Emu3: its text config's type is not registered, the composite's is)
    if not getattr(causal_lm, "_supports_sdpa", True):
        attn = "eager"  # (Gemma 2, GPT-J, MPT, gpt-oss: transformers refuses sdpa for them)
    torch.manual_seed(seed)
    if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn).eval()
    return causal_lm._from_config(config, dtype=dtype, attn_implementation=attn).eval()
