"""Every config value's rule (type, range or choices), checked in one line before weights load.

One place, so that no field goes unchecked: a value's type (None allowed, list items, a `Literal`'s choices) comes
from the annotation of the dataclass field it fills: the top-level keys are `Run`'s fields below, `generation.*`
`Sampling`'s, `model.*` `ModelSpec`'s, `method.*` and `dataset.*` their `_target_` class's. Its range comes from
`RANGES`, by field name (a name means the same in every class), or `Class.field` where it does not. `setup(cfg)`
calls `check(cfg)` first, so the run, `validate`, the grid launcher and merge refuse the same values.
tests/unit/test_schema.py fails for a numeric, text or untyped field of any config class without an entry here, and
probes every rule with values it must refuse; a class's own `__post_init__` keeps what a range cannot say (odd
kernels, a window below the budget, names from a registry: `OWN` here).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import json
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal

from omegaconf import DictConfig, ListConfig, OmegaConf

from kvbench.engine.generation import Sampling
from kvbench.engine.recompress import DecodeCompression
from kvbench.methods.wrappers import Switches
from kvbench.models.loader import ModelSpec
from kvbench.remote.spec import RemoteSpec, is_remote
from kvbench.runs.rules import (PACKAGE, SNAPSHOT, Range, Rule, fits, problem_line,  # noqa: F401  (Rule, fits:
                                 rule_json, source_hash)  # this module's API too)


@dataclass
class Run:
    """configs/config.yaml's own keys, declared for their rules (never built; the `generation`, `model`, `method`
    and `dataset` nodes have their own classes)."""

    budget: int | None
    ratio: float | None
    seed: int
    query: Literal["aware", "agnostic"]
    positions: Literal["original", "shift"]
    compress_after: Literal["layer", "prefill"]
    limit: int | None
    shard: Any
    batch_size: int
    step: Literal["eager", "static", "captured"]
    retry_failed: bool
    report: bool
    results_dir: str
    paper_settings: dict | None


NODES = {"generation": Sampling, "model": ModelSpec, "decode_compression": DecodeCompression}  # no `_target_`


def at_least(low: float, note: str = "") -> Range:
    return Range(low=low, note=note)


def above(low: float, note: str = "") -> Range:
    return Range(low=low, open_low=True, note=note)


def within(low: float, high: float, note: str = "", open_low: bool = False, open_high: bool = False) -> Range:
    return Range(low=low, high=high, open_low=open_low, open_high=open_high, note=note)


def one_of(*choices, note: str = "") -> Range:
    return Range(choices=choices, note=note)


TEXT = Range(free=True)
OWN = Range(owner="its class's __post_init__")
UNBOUNDED = Range()  # every value of the type means something
SCORE_NAME = Range(default_only=True, note="the score this dataset reports")

RANGES: dict[str, Range] = {
    # --- the top level (Run) and generation (Sampling)
    "Run.budget": Range(owner="the method's check_budget"),  # it knows its floor (window, sinks)
    "ratio": within(0, 1, "fraction of prompt entries removed", open_high=True),
    "seed": at_least(0),
    "limit": Range(low=1, says="a positive number of samples, or null for all"),
    "shard": Range(owner="Shard.parse"),
    "batch_size": at_least(1, "samples decoded together"),
    "results_dir": TEXT,
    "paper_settings": TEXT,  # the manifest's `paper` block: a description, read by no code
    # --- the load benchmark's `serving` node (kvbench.serving.spec.ServingSpec; configs/serving/)
    "ServingSpec.pool_bytes": at_least(1, "bytes of KV the pool holds"),
    "ServingSpec.pool_requests": above(0, "full-cache requests of the longest prompt the pool holds"),
    "ServingSpec.rate": above(0, "poisson arrivals, requests/s"),
    "ServingSpec.concurrency": at_least(1, "clients of a closed loop"),
    "ServingSpec.max_batch": at_least(1, "requests decoding at once"),
    "ServingSpec.ttft_slo_s": above(0, "goodput's time-to-first-token target, seconds (null: none)"),
    "ServingSpec.tpot_slo_s": above(0, "goodput's time-per-output-token target, seconds (null: none)"),
    "temperature": above(0, "the sampling temperature"),
    "top_k": at_least(0, "0: no top-k cut"),
    "top_p": within(0, 1, "the nucleus' probability mass; 1: no cut", open_low=True),
    "num_beams": at_least(1, "1: no beam search"),
    "length_penalty": UNBOUNDED,
    "every": at_least(1, "generated tokens between two decode-time compressions"),
    "target": Range(low=1, says="a positive number of entries per head, or null (off)"),
    "DecodeCompression.ratio": within(0, 1, "fraction of the tokens seen removed while decoding; null: off or target",
                                      open_high=True),
    # --- model (ModelSpec)
    "name": TEXT,
    "path": TEXT,
    "revision": TEXT,
    "dtype": OWN,
    "attn_implementation": OWN,
    "device": OWN,
    "device_map": OWN,
    "max_prompt_tokens": at_least(1, "prompt tokens kept"),
    "quant_friendly_layers": at_least(0, "layer indices"),
    "gpus": at_least(0, "GPUs a cluster job asks for"),
    "mem_gb": at_least(1, "GiB a cluster job asks for"),
    # --- model=openai (RemoteSpec): a server's address and how requests are sent
    "base_url": OWN,
    "tokenizer": TEXT,
    "served": TEXT,
    "concurrency": at_least(1, "requests in flight at once"),
    "timeout_s": above(0, "seconds one request may take"),
    "api_key_env": TEXT,
    # --- methods: entry counts, window sizes, shares of the budget
    "window": at_least(1),
    "kernel": at_least(1),
    "beta": at_least(1),
    "alpha": within(0, 1, "share of each head's budget it keeps"),
    "n_sink": at_least(0, "first entries always kept"),
    "stride": at_least(2),
    "threshold": at_least(1),
    "RKV.threshold": within(-1, 1, "cosine similarity above which two keys are copies"),
    "mix_lambda": within(0, 1, "importance's weight; 1 - it: redundancy's"),
    "divide_length": at_least(1, "sequence tokens between two decode-time compressions"),
    "tw_ratio": above(0),
    "epsilon": at_least(0),
    "n_future_positions": at_least(1),
    "recent": at_least(0, "last prompt positions always kept"),
    "StreamingLLM.recent": at_least(1, "null: n_sink sinks and the most recent rest"),
    "recent_ratio": within(0, 1, "share of the budget kept for recent entries", open_high=True),
    "recent_size": at_least(0),
    "tau_init": above(0),
    "tau_end": above(0),
    "budget_fraction": within(0, 1, open_low=True),
    "padded_length": at_least(1),
    "chunk_size": at_least(1),
    "prev_postfix_size": at_least(0),
    "prompt_ids": OWN,
    "page_size": at_least(1),
    "dense_layers": at_least(0),
    "sink_size": at_least(0),
    "partitions": at_least(1),
    "PQCache.bits": within(1, 8, "codes are stored in one byte"),
    "TailorKV.bits": one_of(1, 2, 4, 8),
    "KIVI.bits": one_of(1, 2, 4, 8),
    "arithmetic": OWN,  # kivi | tailorkv (kvbench.cache.quantizer.ARITHMETIC)
    "kmeans_iters": at_least(0),
    "group_size": at_least(1),
    "residual": at_least(1),
    "start_size": at_least(0),
    "channels": at_least(1),
    "quant_layers": at_least(0, "layer indices"),
    "channel_query": OWN,
    # --- kvpress's presses (issue 35)
    "block_size": at_least(0, "prompt entries per block; 0: one shot"),
    "lag_size": at_least(2, "entries per partition"),
    "leverage": OWN,
    "local_window": at_least(1, "entries per local normalisation window"),
    "sketch_dimension": at_least(1, "columns of the Gaussian sketch"),
    "chunk_length": at_least(1, "entries per chunk"),
    "low_entropy_chunk_length": at_least(1, "entries a spiky chunk keeps"),
    "first_stage_ratio": within(0, 1, "share of the budget kept by the first scores alone"),
    "TailorKV.rest": OWN,
    # --- kvpress's wrappers, switches on any selector (kvbench/methods/wrappers.py Switches)
    "whole_layers": at_least(0, "layer indices kept whole"),
    "layer_ratios": within(0, 1, "fraction of each layer's entries removed", open_high=True),
    "Switches.chunk_length": at_least(1, "entries per chunk"),
    "Switches.block_size": at_least(1, "prompt entries per block"),
    "then": Range(owner="the method registry (configs/method/<name>.yaml)"),
    "first_ratio": within(0, 1, "fraction of the prompt the first method removes", open_high=True),
    "merge_threshold": within(0, 1, "least key cosine at which an evicted entry merges (with merge=true)"),
    "merge_fraction": within(0, 1, "share of the passing evicted entries that merge (with merge=true)",
                             open_low=True),
    "quantize": OWN,  # kivi1 | kivi2 | kivi4 | kivi8 (kvbench.methods.quantize.SCHEMES)
    "quantize_group": at_least(1, "tokens per key group, channels per value group (with quantize)"),
    "quantize_residual": at_least(1, "most recent kept entries in full precision (with quantize)"),
    # --- SimLayerKV
    "lazy_threshold": within(0, 1, "attention mass on sinks + recent above which a layer is lazy"),
    "n_last": at_least(1, "last prompt queries that judge a layer"),
    "sink_size_start": at_least(0, "first entries always kept"),
    "sink_size_end": at_least(0, "last entries always kept"),
    "blending": at_least(0, "the leverage scores' weight; null: the compression ratio"),
    "tau": above(0, "temperature of the query-key alignment weights"),
    "leverage_chunk": at_least(1, "keys per leverage chunk"),
    "Finch.window": at_least(0, "last prompt tokens scoring the context; 0: the question"),
    "key_channels": within(0, 1, "share of each head's key channels pruned (ThinK); 0: off", open_high=True),
    "channel_window": at_least(1, "last prompt queries scoring the key channels"),
    "Finch.chunk_length": at_least(0, "entries per chunk; 0: one top-k over the prompt"),
    "filters": OWN,  # auto | prompt | a file (kvbench.methods.artefacts.check_source)
    "pattern": OWN,
    "curve": OWN,
    "stats": OWN,
    "stats_revision": TEXT,
    "head_ratio": within(0, 1, "share of the heads that stream"),
    "sink": at_least(0, "first entries always kept"),
    "DMS.threshold": Range(note="a score: entries below it, outside the window, are evicted"),
    "weights": TEXT,
    # --- kvpress's presses (issue 35: kvcompose, kvgrad, cam, restorekv)
    "keep_token_lower_bound": at_least(0, "entries every layer keeps first"),
    "merge_budget": at_least(1, "entries a leaving entry's value is shared with"),
    # --- Fast KVzip
    "gates": OWN,  # auto | random | a file (FastKVzip.__post_init__)
    "window_ratio": within(0, 1, "share of the context kept as the recent window", open_high=True),
    "window_size": at_least(1, "recent entries kept from 32k tokens on"),
    # --- KVCache-Factory's 2026 additions (issue 45)
    "random_budget": at_least(0, "entries per head kept by random eviction"),
    "random_temperature": UNBOUNDED,  # <= 0: uniform draw
    "history_window": Range(low=1, says="a positive number of query rows, or null for all"),
    "decay": at_least(0, "share of earlier importance kept at each update"),
    "start_layer": Range(low=0, says="a layer index, or null for the middle layer"),
    "interpolation": within(0, 1, "SLERP weight of the deeper layer"),
    "retention_ratio": within(0, 1, "share of tokens kept unmerged"),
    "GEAR.bits": one_of(2, 4),
    "KVQuant.bits": one_of(1, 2, 4, 8),
    "outliers": within(0, 1, "share of each vector kept exactly", open_high=True),
    "sparsity": within(0, 1, "share of entries kept as outliers", open_high=True),
    "rank": at_least(0, "rank of the low-rank part; 0: none"),
    "loop": at_least(0, "power-iteration rounds"),
    # --- datasets
    "version": TEXT,
    "Ruler.version": OWN,
    "Summarization.name": OWN,
    "root": TEXT,
    "split": TEXT,
    "tasks": OWN,
    "protocol": OWN,
    "scorer": OWN,
    "mode": OWN,
    "turn_mode": OWN,
    "code_sim_backend": OWN,
    "model_template": OWN,
    "metrics": OWN,
    "primary_metric": SCORE_NAME,
    "NeedleHaystack.primary_metric": OWN,  # one of its `metrics`
    "kind": Range(default_only=True, note="how kvbench runs its samples"),
    "chat_format": TEXT,
    "needle": TEXT,
    "retrieval_question": TEXT,
    "expected_answer": TEXT,
    "template": TEXT,
    "stop": TEXT,
    "haystack_dir": TEXT,
    "qa_root": TEXT,
    "essays_json": TEXT,
    "length_tokenizer": TEXT,
    "length_tokenizer_revision": TEXT,
    "cache_dir": TEXT,
    "max_new_tokens": at_least(1, "new tokens per sample"),
    "cot_answer_max_new_tokens": at_least(1, "new tokens of the second CoT question"),
    "limit_per_task": at_least(1),
    "num_samples": at_least(1),
    "truncate_tokens": at_least(1),
    "max_seq_length": at_least(1),
    "max_turns": at_least(1),
    "turns": at_least(1),
    "num_rows": at_least(1),
    "rows_per_record": at_least(1),
    "context": at_least(1, "prefilled tokens per window"),
    "length": at_least(1, "prompt + new tokens"),
    "lengths": at_least(1, "prompt + new tokens"),
    "random_seed": at_least(0),
    "context_lengths": at_least(1, "tokens"),
    "depth_percents": within(0, 100),
    "final_context_length_buffer": at_least(0),
    "gold_positions": within(0, 9, "the source ships 0, 4, 9"),
    "prompt_lengths": at_least(1, "tokens"),
    "generation_lengths": at_least(1, "tokens"),
    "samples": at_least(1, "generations per problem"),
    "num_fewshot": at_least(0, "examples before the question"),
    "fewshot_seed": at_least(0),
    "Gsm8k.protocol": Range(note="lm-eval's task"),
    "LongBenchV2.difficulty": one_of("easy", "hard", note="questions kept"),
    "LongBenchV2.lengths": one_of("short", "medium", "long", note="questions kept"),
}


# --- rules from annotations -----------------------------------------------------------------------------------
def parse_annotation(annotation) -> tuple[type | None, bool, bool, tuple]:
    """(kind, null allowed, a list, Literal choices) of `int | None`, `list[int]`, `Literal["a", "b"]`, ..."""
    null = False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        rest = [a for a in args if a is not type(None)]
        null, annotation = len(rest) < len(args), (rest[0] if len(rest) == 1 else Any)
    many = annotation in (list, tuple) or typing.get_origin(annotation) in (list, tuple)
    if many:
        args = [a for a in typing.get_args(annotation) if a is not Ellipsis]
        annotation = args[0] if args else Any
    if typing.get_origin(annotation) is Literal:
        choices = typing.get_args(annotation)
        return type(choices[0]), null, many, choices
    if annotation in (int, float, bool, str):
        return annotation, null, many, ()
    return None, null or annotation is Any, many, ()


def find_range(cls: type, name: str) -> Range | None:
    for klass in cls.__mro__:
        if f"{klass.__name__}.{name}" in RANGES:
            return RANGES[f"{klass.__name__}.{name}"]
    return RANGES.get(name)


@functools.cache
def rules_of(cls: type) -> dict[str, Rule | None]:
    """Each init field of a config class -> its rule; None where a number, text or untyped value has no range."""
    hints = typing.get_type_hints(cls)
    rules: dict[str, Rule | None] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        kind, null, many, choices = parse_annotation(hints[f.name])
        found = find_range(cls, f.name)
        if choices:
            found = dataclasses.replace(found or Range(), choices=choices)
        elif found is not None and found.default_only:
            found = dataclasses.replace(found, choices=(f.default,))
        elif found is None and kind is not bool:
            rules[f.name] = None
            continue
        rules[f.name] = Rule(kind, null, many, found or Range())
    return rules


def method_rules(cls: type) -> dict[str, Rule | None]:
    """A method's rules, and those of the kvpress-wrapper switches any selector's node may carry (where not the
    method's own fields: keydiff's `block_size`)."""
    return {**rules_of(Switches), **rules_of(cls)}


# --- a composed config's values -------------------------------------------------------------------------------
def node_class(node) -> type | None:
    """The dataclass a method or dataset node's `_target_` names (None: instantiate will say what is wrong)."""
    module, _, name = str(node.get("_target_", "")).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name) if module else None
    except (ImportError, AttributeError):
        return None
    return cls if dataclasses.is_dataclass(cls) else None


def leaves(cfg: DictConfig) -> Iterator[tuple[str, Any, Rule | None, str]]:
    """(key, value, its rule or None, component) for every value of a composed config, Hydra's own node aside."""
    for key in cfg:
        if key == "hydra":
            continue
        node = cfg[key]
        cls = None
        if isinstance(node, DictConfig):
            cls = NODES.get(key) or (node_class(node) if key in ("method", "dataset") else None)
            cls = RemoteSpec if key == "model" and is_remote(node) else cls  # model=openai: a server
        if cls is None:
            value = OmegaConf.to_container(node, resolve=True) if isinstance(node, (DictConfig, ListConfig)) else node
            yield key, value, rules_of(Run).get(key), ""
            continue
        rules, who = (method_rules if key == "method" else rules_of)(cls), getattr(cls, "registry_name", "")
        for name, value in OmegaConf.to_container(node, resolve=True).items():
            if name != "_target_":
                yield f"{key}.{name}", value, rules.get(name), who


def check(cfg: DictConfig) -> None:
    """Raise ValueError, one line naming the key, its value and what it may be, at the first value that breaks its
    rule. Keys without a rule (a user's `+key=...`) are left to the code that reads them."""
    for key, value, rule, who in leaves(cfg):
        line = problem_line(key, value, rule, who) if rule is not None else None
        if line is not None:
            raise ValueError(line)


def unruled(cfg: DictConfig) -> list[str]:
    """The keys of a composed config that have no rule (tests/unit/test_schema.py keeps this empty)."""
    return [key for key, _, rule, _ in leaves(cfg) if rule is None]


# --- rules.json: what kvbench.runs.rules.check_early reads before torch is imported -----------------------------
def snapshot() -> dict:
    """Every built-in config class's rules (as `leaves` finds them), the source files they come from (hashed: a
    changed file sets its class aside until the file is rewritten), its defaults, and for a method its
    `check_budget`'s refusal of a budget below 1 at those defaults."""
    from kvbench import data, methods  # noqa: F401  (register the built-in classes)
    from kvbench.registry import DATASETS, METHODS

    classes = {}
    method_classes = [METHODS[n] for n in METHODS.names()]
    for cls in [Run, *NODES.values(), RemoteSpec, *method_classes, *(DATASETS[n] for n in DATASETS.names())]:
        is_method = cls in method_classes
        rules = (method_rules if is_method else rules_of)(cls)
        owners = [k for k in cls.__mro__ if k.__module__.startswith("kvbench.")] + ([Switches] if is_method else [])
        files = {str(Path(inspect.getsourcefile(k)).resolve().relative_to(PACKAGE)) for k in owners}
        files |= {"runs/schema.py", "runs/rules.py"}
        classes[f"{cls.__module__}.{cls.__qualname__}"] = {
            "who": getattr(cls, "registry_name", ""),
            "sources": {path: source_hash(path) for path in sorted(files)},
            "rules": {name: rule_json(rule) for name, rule in rules.items()},
            "defaults": json.loads(json.dumps(defaults(cls), default=str)),
            "budget_refusal": budget_refusal(cls) if is_method else None,
        }
    return {"written_by": "python -m kvbench.runs.schema", "classes": classes}


def defaults(cls: type) -> dict:
    out = {}
    for f in dataclasses.fields(cls):
        if f.init and f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.init and f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def budget_refusal(cls: type) -> str | None:
    """`check_budget`'s line for budget=-1 as a template (`{budget}`), where the method at its defaults refuses -1,
    0 and null alike (a method that ignores its budget refuses none of them: None)."""
    try:
        method = cls()
    except Exception:  # noqa: BLE001 - a class that needs arguments: left to setup
        return None
    if not getattr(method, "compresses", True):
        return None
    lines = []
    for budget in (-1, 0, None):
        try:
            method.check_budget(budget)
            return None
        except ValueError as e:
            lines.append(str(e).replace(f"budget={budget!r}", "budget={budget}"))
    return lines[0] if len(set(lines)) == 1 and "{budget}" in lines[0] else None


def write_snapshot() -> None:
    """rules.json, one class a line (a changed class changes its own line)."""
    found = snapshot()
    lines = [f"  {json.dumps(name)}: {json.dumps(entry, sort_keys=True)}"
             for name, entry in sorted(found["classes"].items())]
    SNAPSHOT.write_text('{"written_by": "python -m kvbench.runs.schema", "classes": {\n' + ",\n".join(lines) + "\n}}\n")


if __name__ == "__main__":  # rewrite rules.json after changing a config class or RANGES (as the module, so that
    from kvbench.runs import schema  # the classes are named kvbench.runs.schema.Run, not __main__.Run)

    schema.write_snapshot()
    print(f"wrote {SNAPSHOT}")
