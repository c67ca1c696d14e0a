"""Composite (vision-language) checkpoints on text benchmarks: load the checkpoint as published, keep its text decoder
and LM head as a text-only causal LM, drop the rest.

Why: Gemma 3/4, Qwen3.5, Llama 4 and Mistral 3 are published as vision-language checkpoints (`model_type` gemma3,
gemma4, qwen3_5, llama4, mistral3); a user who names the Hub id expects the language model to run. The text decoder
of these composites is the same class as the text-only model (`Gemma3TextModel`, `MistralModel`, ...), so kvbench
hands that decoder and the LM head to the text-only causal-LM class transformers maps the text config to, and every
adapter, capture and method sees an ordinary decoder. Weights are loaded once, by transformers, under their own names.
"""
from __future__ import annotations

import torch

from kvbench.models.groups import COMPOSITE


def is_composite(model_type: str | None) -> bool:
    return model_type in COMPOSITE


def text_causal_lm(composite: torch.nn.Module) -> torch.nn.Module:
    """A text-only causal LM (the class transformers maps the text config to) holding `composite`'s text decoder and
    LM head: the same modules, so the same weights and logits for text input."""
    from transformers import AutoModelForCausalLM

    text_config = composite.config.get_text_config(decoder=True)
    decoder, head = composite.get_decoder(), composite.get_output_embeddings()
    if hasattr(decoder, "get_output_embeddings") and decoder.get_output_embeddings() is not None:
        return decoder.eval()  # Llama 4: the composite holds a whole text causal LM
    if decoder is None or head is None:
        raise ValueError(f"model: {composite.config.model_type} checkpoint: its text decoder or LM head could not be "
                         "found (get_decoder / get_output_embeddings)")
    text_config._attn_implementation = composite.config._attn_implementation
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(text_config)
    setattr(model, model.base_model_prefix, decoder)
    model.set_output_embeddings(head)
    model.config = decoder.config
    left = [name for name, p in model.named_parameters() if p.is_meta]
    if left:
        raise ValueError(f"model: {composite.config.model_type} checkpoint: the text model kvbench built from it lacks "
                         f"{left[0]} (and {len(left) - 1} more)")
    return model.to(next(decoder.parameters()).dtype).eval()


def load_text_decoder(source: str, **kwargs) -> torch.nn.Module:
    """The text decoder of a composite checkpoint at `source` (a folder or Hub id): transformers loads the
    checkpoint with its own class and weight names; kvbench keeps the text part (`text_causal_lm`)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(source, revision=kwargs.get("revision"),
                                        trust_remote_code=kwargs.get("trust_remote_code", False))
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    auto = AutoModelForCausalLM if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else (
        AutoModelForImageTextToText)
    composite = auto.from_pretrained(source, **kwargs)
    return text_causal_lm(composite)
