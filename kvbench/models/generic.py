"""The generic path: an adapter for any decoder type whose attention goes through transformers' AttentionInterface.

How attention is found: the type's modeling module (transformers' own mapping from model_type to module) is searched
for the classes whose `forward` fetches its kernel from `ALL_ATTENTION_FUNCTIONS`, i.e. the classes that call the
interface the capture registers its function with; the loaded model's instances of that class, each with its
`layer_idx`, are the layers. Nothing is guessed from attribute names. Which layers are sliding-window or chunked
comes from transformers' own per-layer cache kinds (`cache_utils.get_layer_types_and_kwargs`, what `DynamicCache`
builds its layers from), whether sdpa is allowed from the model class (`_supports_sdpa`).

What cannot be found from the code before weights load is declared in `kvbench.models.groups` (the group of a type
to refuse, the rotary layout and NoPE layers `positions=shift` depends on); where a query is formed (projection,
norm, rotation: TailorKV's q-hat, Expected Attention's rotary) is found from the model's own queries at the first
prefill (`kvbench.models.query_form`).
"""
from __future__ import annotations

import importlib
import inspect
from functools import lru_cache

from kvbench.models.groups import (ATTENTION_KINDS, COMPOSITE, INTERLEAVED_ROTARY, NOPE_LAYERS, NOT_DECODER_LM,
                                   QUERY_TEMPERATURE, WINDOW_KINDS, group_refusal)


def causal_lm_types() -> dict[str, str]:
    """transformers' {model_type: causal-LM class name}."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def decoder_types() -> list[str]:
    """The decoder-only text types of the installed transformers (142 in 5.23): causal-LM types that are neither
    encoder/speech/captioning models nor composite wrappers of a `*_text` type."""
    return [t for t in causal_lm_types() if t not in NOT_DECODER_LM and t not in COMPOSITE]


@lru_cache(maxsize=None)
def modeling_module(model_type: str) -> str:
    """`<module>.modeling_<module>` under transformers.models where `model_type`'s causal-LM class lives (gpt-sw3's is
    gpt2's), found through transformers' own lazy class registry."""
    import transformers

    cls = getattr(transformers, causal_lm_types()[model_type])
    return cls.__module__.removeprefix("transformers.models.")


def _import(name: str):
    try:
        return importlib.import_module(f"transformers.models.{name}")
    except ImportError:
        return None


def calls_interface(cls: type) -> bool:
    """Whether `cls.forward` takes its attention kernel from transformers' `ALL_ATTENTION_FUNCTIONS`."""
    forward = getattr(cls, "forward", None)
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in source


@lru_cache(maxsize=None)
def interface_attention_classes(modeling: str) -> tuple[type, ...]:
    """The classes defined in transformers.models.`modeling` whose forward calls the AttentionInterface and that
    hold a `layer_idx` (vision towers and encoders do not index a decoder cache)."""
    module = _import(modeling)
    if module is None:
        return ()
    found = []
    for _, cls in inspect.getmembers(module, inspect.isclass):
        if cls.__module__ != module.__name__ or not calls_interface(cls):
            continue
        init = inspect.getsource(cls.__init__) if "__init__" in cls.__dict__ else ""
        if "layer_idx" in init:
            found.append(cls)
    return tuple(found)


def decoder_attention_classes(modeling: str, config) -> tuple[type, ...]:
    """The interface attention classes built from the decoder's own config class (a composite module also holds
    vision/audio attention classes, built from their own configs)."""
    classes = interface_attention_classes(modeling)
    name = type(text_config(config)).__name__
    own = tuple(c for c in classes if _config_annotation(c) == name)
    return own or classes


@lru_cache(maxsize=None)  # (per class: inspect reads the source file each call, ~10 ms an adapter lookup)
def _config_annotation(cls: type) -> str | None:
    parameter = inspect.signature(cls.__init__).parameters.get("config")
    annotation = None if parameter is None else parameter.annotation
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", None)


def passes_sinks(classes: tuple[type, ...]) -> bool:
    """Whether an attention class hands learned sink logits to the kernel (`s_aux=`)."""
    return any(_hands_s_aux(cls) for cls in classes)


@lru_cache(maxsize=None)
def _hands_s_aux(cls: type) -> bool:
    return "s_aux" in inspect.getsource(cls.forward)


def text_config(config):
    """The decoder's config of a (possibly composite) config object."""
    return config.get_text_config(decoder=True)


def names_field(text, name: str) -> bool:
    """Whether a decoder config sets `name` for some layer. A per-layer config (dots.llm3's `per_layer_config`)
    refuses a global read of a field its layers set differently (transformers' AmbiguousGlobalPerLayerAttributeError,
    a RuntimeError): then some layer sets it."""
    try:
        return getattr(text, name, None) is not None
    except RuntimeError:
        return True


def layer_kinds(config) -> list[str]:
    """transformers' per-layer cache kinds for `config` (what `DynamicCache(config=...)` builds)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    return list(get_layer_types_and_kwargs(text_config(config))[0])


def layer_windows(config) -> dict[int, tuple[str, int]]:
    """{layer: (kind, size)} of the sliding-window and chunked layers that `config.layer_types` names (a uniform window
    without layer_types is applied through the attention's `sliding_window` kwarg instead, as for Mistral)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    text = text_config(config)
    if not getattr(text, "layer_types", None):
        return {}
    kinds, kwargs = get_layer_types_and_kwargs(text)
    return {i: (kind, kw["sliding_window"]) for i, (kind, kw) in enumerate(zip(kinds, kwargs))
            if kind in WINDOW_KINDS and kw.get("sliding_window")}


def config_object(model_type: str, config: dict | None):
    """A transformers config of `model_type` from config.json fields (defaults when None); no weights."""
    from transformers import AutoConfig

    fields = {k: v for k, v in (config or {}).items() if k not in ("model_type", "transformers_version")}
    return AutoConfig.for_model(model_type, **fields)


def generic_refusal(model_type: str, config) -> str | None:
    """Why the generic path cannot run `config` (a config object of `model_type`), group first; None if it can."""
    reason = group_refusal(model_type)  # the survey's table first: no need to read more
    if reason is not None:
        return reason
    text = text_config(config)
    modeling = modeling_module(model_type)
    classes = decoder_attention_classes(modeling, config)
    try:
        kinds = layer_kinds(config)
    except (AttributeError, KeyError, ValueError) as e:
        return f"transformers cannot build its cache layers from this config ({type(e).__name__}: {e})".split("\n")[0]
    reason = group_refusal(model_type, kinds, mla=names_field(text, "kv_lora_rank"),
                           sinks=passes_sinks(classes), indexer_types=getattr(text, "indexer_types", None))
    if reason is not None:
        return reason
    if not classes:
        return ("its attention does not go through transformers' AttentionInterface (its own kernel), so kvbench "
                "cannot capture it without a hand-written replacement")
    if len(classes) > 1:
        return (f"its modeling code has {len(classes)} attention classes ({', '.join(c.__name__ for c in classes)}); "
                "the generic path needs one per decoder layer")
    return None


def generic_fields(model_type: str, config) -> dict:
    """The adapter fields (`kvbench.models.adapters.Adapter`) of a type the generic path runs (check
    `generic_refusal` first)."""
    text = text_config(config)
    modeling = modeling_module(model_type)
    (attention,) = decoder_attention_classes(modeling, config)
    kinds = layer_kinds(config)
    lm_class = getattr(_import(modeling), causal_lm_types()[model_type], None)
    rope = getattr(text, "rope_parameters", None) is not None or getattr(text, "rope_theta", None) is not None
    return dict(
        family=model_type, model_types=(model_type,), modeling=modeling, attention=attention.__name__,
        positions="rope" if rope else "learned",
        rotary_layout="interleaved" if model_type in INTERLEAVED_ROTARY else "half",
        has_window_layers=bool(getattr(text, "layer_types", None)) and any(k in WINDOW_KINDS for k in kinds),
        sdpa=bool(getattr(lm_class, "_supports_sdpa", True)),
        generic=True, nope_layers=model_type in NOPE_LAYERS, query_temperature=model_type in QUERY_TEMPERATURE,
        chunked_layers="chunked_attention" in kinds, indexed_layers="indexed_attention" in kinds)


__all__ = ["ATTENTION_KINDS", "config_object", "decoder_types", "generic_fields", "generic_refusal", "layer_kinds",
           "layer_windows", "modeling_module"]
