"""Which group each decoder model type of transformers 5.23 belongs to, and the one-line reason a type kvbench cannot
run yet is refused (docs/methods.md's table lists all 142 decoder-only text types of transformers 5.23).

Why a table at all: most of a type's structure is found from the model (`kvbench.models.generic`), but a few facts
decide a refusal before any weights load and cannot be read from a config.json alone (a hybrid whose config names
no `layer_types`, attention that bypasses transformers' AttentionInterface, KV shared across layers). New types are
still classified by what can be found: transformers' own per-layer cache kinds (`layer_kinds`), an MLA config
(`kv_lora_rank`) and attention that passes learned sinks (`s_aux`); the table only adds what those miss.

Each refusal names its group first ("hybrid: ...", "sinks: ...", "MLA: ..."): the engineers adding those groups
replace the refusals of their group.
"""
from __future__ import annotations

# per-token K/V only ("indexed_attention": a DSA layer, MLA latents plus its indexer's keys, evicted together)
ATTENTION_KINDS = frozenset({"full_attention", "sliding_attention", "chunked_attention", "indexed_attention"})
WINDOW_KINDS = frozenset({"sliding_attention", "chunked_attention"})

# encoder-decoder decoder halves, BERT-likes used as decoders, speech/music, image captioners, legacy LMs: not decoder
# text LMs (the 47 types of the 189 in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES that the survey leaves out)
NOT_DECODER_LM = frozenset({
    "bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "mvp", "pegasus", "plbart",
    "prophetnet", "trocr", "whisper", "bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra",
    "ernie", "megatron-bert", "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "xlm-roberta",
    "xlm-roberta-xl", "xmod", "xlm", "musicgen", "musicgen_melody", "moshi", "moss_transcribe_diarize", "fuyu", "git",
    "got_ocr2", "xlnet", "reformer"})

# composite (vision-language) configs whose text decoder kvbench runs (`text_config`); their own type is not a
# decoder of its own
COMPOSITE = frozenset({"gemma3", "gemma4", "gemma4_unified", "qwen3_5", "qwen3_5_moe", "qwen4_exp", "llama4",
                       "mistral3", "dots3_note", "gemma3n"})
# text configs transformers does not register, by the decoder type whose causal-LM class is built from them
TEXT_CONFIG_TYPES = {"emu3_text_model": "emu3"}

HYBRID = frozenset({
    "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "jamba", "zamba", "zamba2", "bamba", "falcon_h1", "lfm2",
    "lfm2_moe", "lfm3", "nemotron_h", "granitemoehybrid", "minimax", "kimi_linear", "olmo_hybrid", "bailing_hybrid",
    "inkling_text", "inkling2_text", "zaya", "recurrent_gemma", "qwen4_exp_text"})
# the hybrids kvbench runs have a row in adapters.HYBRID_ADAPTERS (checked before this table); the others, and why
HYBRID_REASONS = {
    "recurrent_gemma": "it keeps its cache inside the model (no past_key_values to compress)",
    "inkling_text": "its attention adds a hidden-state-conditioned relative logit bias (no RoPE) that kvbench's "
                    "scoring and decode attention do not reproduce",
    "inkling2_text": "its attention adds a hidden-state-conditioned relative logit bias and learned sinks that "
                     "kvbench's scoring and decode attention do not reproduce",
    "qwen4_exp_text": "its QSA-indexed attention layer (an indexer choosing keys) is not supported",
}
MLA = frozenset({"deepseek_v2", "deepseek_v3", "glm4_moe_lite", "longcat_flash", "axk1", "minicpm3", "youtu",
                 "deepseek_v32", "axk2", "dots3_note_text", "glm_moe_dsa", "hy_v4"})  # run (kvbench/models/mla.py)
# The DSA types (MLA + a sparse-attention indexer over its own cached keys) run too: the capture folds the indexer's
# top-k into the mask (`mla.with_sparse_indices`), and its keys are evicted with their entries. Except a config with
# "shared" indexer layers (hy_v4's default; glm_moe_dsa can): those reuse the previous layer's top-k positions
DSA = frozenset({"deepseek_v32", "axk2", "dots3_note_text", "glm_moe_dsa", "hy_v4"})
SHARED_INDEXER = ("MLA: its \"shared\" sparse-attention indexer layers (indexer_types) reuse the previous layer's "
                  "top-k positions, which point at other tokens once layers keep different entries; use a config whose "
                  "indexer_types are all \"full\"")
SINKS = frozenset({"gpt_oss", "flint", "granite_swa", "granitemoe_swa", "mimo_v2_flash"})  # run (attention/sinks.py)

NO_KV = {
    "mamba": "state-space/recurrent model with no per-token KV cache to compress",
    "mamba2": "state-space/recurrent model with no per-token KV cache to compress",
    "falcon_mamba": "state-space/recurrent model with no per-token KV cache to compress",
    "rwkv": "state-space/recurrent model with no per-token KV cache to compress",
    "xlstm": "state-space/recurrent model (xLSTM) with no per-token KV cache to compress",
    "openai-gpt": "GPT-1 has no KV cache at all in transformers",
    "gemma4_assistant": "a drafter head with no KV of its own (it reads its target model's cache)",
    "gemma4_unified_assistant": "a drafter head with no KV of its own (it reads its target model's cache)",
}

OWN_ATTENTION = frozenset({"cpmant", "gpt_neo", "gpt_neox_japanese", "xglm"})  # (bloom, codegen: hand-written rows)

ODD = {  # attention through the interface, but not one call per layer over the cache it fills
    "gemma3n_text": "layers share KV across layers (the last layers reuse an earlier layer's cache); the "
                    "producer-to-consumer mapping is not implemented",
    "diffllama": "differential attention calls the attention function twice per layer over the same keys",
    "jetmoe": "mixture-of-attention heads repeat keys per query expert, not per KV group",
    "hrm_text": "recurrent depth: one cache slot per layer per cycle, not per layer",
    "doge": "dynamic-mask attention (value-derived mask) that scores would ignore",
    "mllama": "cross-attention layers to the image beside self-attention",
    "blt": "byte-latent patches with cross-attention between local and global models",
    "deepseek_v4": "compressed KV: its CSA/HCA compressor caches are the long-range memory, not per-token entries",
}

# Per-type hints a config.json cannot give (spec §3): the rotary layout positions=shift would re-rotate, and types
# with NoPE layers beside rotary ones (shift, q-hat and Expected Attention must not rotate those). The capture checks
# both against the model's own queries at the first prefill (`kvbench.models.query_form`).
INTERLEAVED_ROTARY = frozenset({"ernie4_5", "ernie4_5_moe", "cohere", "cohere2", "cohere2_moe", "glm", "glm4",
                                "llama4_text", "youtu", "deepseek_v2", "deepseek_v3"})
NOPE_LAYERS = frozenset({"smollm3", "llama4_text", "exaone4", "exaone_moe", "cohere2", "cohere2_moe", "kolibri1",
                         "beam", "granite_swa", "granitemoe_swa", "jamba", "nemotron_h", "granitemoehybrid",
                         "kimi_linear", "olmo_hybrid"})
QUERY_TEMPERATURE = frozenset({"llama4_text", "ministral3", "beam"})  # queries scaled by a position-dependent factor


def group_refusal(model_type: str, layer_kinds: list[str] | None = None, mla: bool = False,
                  sinks: bool = False, indexer_types: list[str] | None = None) -> str | None:
    """Why `model_type` cannot run yet, its group first; None when the generic path can run it. `layer_kinds`
    (transformers' per-layer cache kinds), `mla`, `sinks` and a DSA config's `indexer_types` are what was found from
    its config and code."""
    hybrid = ("hybrid: a hybrid type kvbench has not checked (its recurrent layers' state calls and a tiny config "
              "are covered by tests/unit/test_hybrid.py only for the types in adapters.HYBRID_ADAPTERS)")
    own = ("its attention does not go through transformers' AttentionInterface (its own kernel), so kvbench cannot "
           "capture it without a hand-written replacement")
    known = {**NO_KV, **ODD, **dict.fromkeys(HYBRID, hybrid),
             **{t: f"hybrid: {reason}" for t, reason in HYBRID_REASONS.items()}, 
             **dict.fromkeys(OWN_ATTENTION, own)}
    if model_type in known:
        return known[model_type]
    if "shared" in (indexer_types or ()):
        return SHARED_INDEXER
    kinds = set(layer_kinds or ()) - ATTENTION_KINDS  # a type the table does not know: what was found decides
    if "dummy" in kinds:
        return ("this config shares KV across layers (num_kv_shared_layers or KV-sharing layers); the "
                "producer-to-consumer mapping is not implemented: use a config without KV sharing")
    if kinds & {"heavily_compressed_attention", "compressed_sparse_attention"}:
        return ODD["deepseek_v4"]
    if kinds:
        return hybrid
    return None  # (MLA and sink types run: kvbench/models/mla.py, kvbench/attention/sinks.py)
