"""A run's composed config: where the configs live, the run-dir interpolations, and `setup(cfg)`.

`setup` turns a composed config into (method, dataset, model spec) and runs every check that can fail on user input,
before any weights load; the runner (kvbench.runs.run), the command-line check (kvbench.runs.validate), the grid
launcher and merge all call it, so a config is judged the same way everywhere. Importing this module registers the
`kvbench_*` resolvers that Hydra's run-dir patterns (configs/hydra/) use.
"""
from __future__ import annotations

import hashlib
import json
import sys
import warnings
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
# configs/hydra/launcher/ray.yaml extends hydra-ray-launcher's `ray` under its own name, on purpose
warnings.filterwarnings("ignore", message=r"\s*'hydra/launcher/ray' is validated against ConfigStore schema")
GROUPS = ("method", "dataset", "model")


# --- config helpers (also used by the Hydra run-dir interpolations) -------------------------------------------
# where a run executes, not what it computes: kept out of the run dir's identity (like `limit` and `shard`)
PLACEMENT_KEYS = ("gpus", "mem_gb", "device_map",
                  "concurrency", "timeout_s", "api_key_env")  # (the last three: model=openai's, kvbench.remote)


QUERY_MODES = ("aware", "agnostic")
# keys a config gained after run directories existed: left out of the hash while null (their default), so those
# run directories keep their names and resume; set, they enter it
LATER_KEYS = {"kvbench.data.ruler.Ruler": ("max_new_tokens",), "kvbench.methods.tova.TOVA": ("prefill_only",)}


def config_hash(*nodes) -> str:
    """Short hash of the parts of the config that change results (the run dir's suffix). A last node equal to
    `aware` (the run-dir pattern ends with `${query}`) is left out, so question-aware runs keep the run dirs they
    had before `query` existed; `agnostic` enters the hash. So are `LATER_KEYS` while null, and a last
    `decode_compression` node while it is off (its target and ratio null), and its `ratio` while null."""
    if nodes and isinstance(nodes[-1], DictConfig) and "target" in nodes[-1]:
        if nodes[-1].target is None and nodes[-1].get("ratio") is None:
            nodes = nodes[:-1]
        elif nodes[-1].get("ratio", 0) is None:  # a target's run dirs keep the names they had before `ratio`
            nodes = (*nodes[:-1], OmegaConf.create({k: v for k, v in nodes[-1].items() if k != "ratio"}))
    if nodes and isinstance(nodes[-1], str) and nodes[-1] == QUERY_MODES[0]:
        nodes = nodes[:-1]
    plain = [OmegaConf.to_container(n, resolve=True) if isinstance(n, DictConfig) else n for n in nodes]
    plain = [{k: v for k, v in n.items() if k not in PLACEMENT_KEYS} if isinstance(n, dict) else n for n in plain]
    plain = [{k: v for k, v in n.items() if v is not None or k not in LATER_KEYS.get(n.get("_target_"), ())}
             if isinstance(n, dict) else n for n in plain]
    return hashlib.sha256(json.dumps(plain, sort_keys=True, default=str).encode()).hexdigest()[:8]


FULL_TARGET = "kvbench.methods.full.Full"  # keeps everything: one run per (model, dataset), whatever the budget


def budget_tag(budget, ratio, method_target: str = "") -> str:
    if method_target == FULL_TARGET:
        return "all"
    return f"r{ratio}" if ratio is not None else f"b{budget}"


OmegaConf.register_new_resolver("kvbench_hash", config_hash, replace=True)
OmegaConf.register_new_resolver("kvbench_budget", budget_tag, replace=True)
OmegaConf.register_new_resolver(  # each shard of a run logs to its own file in the shared run dir
    "kvbench_shard_suffix", lambda shard: f".shard-{str(shard).replace('/', '-of-')}" if shard else "", replace=True)


def yaml_message(e: Exception) -> str:
    """A YAML parser's error as one line naming the file, line and column: `configs/method/mine.yaml:3:9: not valid
    YAML: mapping values are not allowed here`."""
    mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None) or str(e).strip().splitlines()[0]
    where = f"{mark.name}:{mark.line + 1}:{mark.column + 1}" if mark is not None else "a config file"
    return f"{where}: not valid YAML: {problem}"


def load_yaml(path: Path) -> DictConfig:
    """`OmegaConf.load`, a syntax error turned into a one-line ValueError naming the file and line."""
    import yaml

    try:
        return OmegaConf.load(path)
    except yaml.YAMLError as e:
        raise ValueError(yaml_message(e)) from None


def group_choices(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def check_group_overrides(argv: list[str]) -> None:
    """Fail in one line, before Hydra's multi-line error, on an unknown method/dataset/model name."""
    from kvbench.registry import unknown_choice

    for arg in argv:
        key, _, value = arg.lstrip("+~").partition("=")
        if key in (*GROUPS, "paper") and value:
            choices = group_choices(key)
            for name in value.split(","):
                if name not in choices:
                    hint = " (or model=hf model.path=<hub id | local dir | file.gguf>)" if key == "model" else ""
                    sys.exit(f"kvbench: {unknown_choice(key, name, choices)}{hint}")


# --- setup: everything that can fail on bad input, before weights load ----------------------------------------
def setup(cfg: DictConfig):
    from kvbench import methods  # noqa: F401  (registers the built-in methods)
    from kvbench.models.checks import check_source
    from kvbench.methods.latent import check_latent
    from kvbench.models.loader import ModelSpec, check_architecture, is_latent_model
    from kvbench.remote.spec import is_remote
    from kvbench.runs.schema import check

    check(cfg)  # every value's type, range or choices (kvbench/runs/schema.py), before anything is built
    method = build_method(cfg.method, build, cfg.model)
    dataset = build(cfg.dataset, "dataset")
    if is_remote(cfg.model):  # model=openai: generation is an external server's (kvbench.remote)
        return setup_remote(cfg, method, dataset)
    if hasattr(dataset, "check"):  # e.g. LongBench's data folder: fail before weights load
        dataset.check()
    spec = ModelSpec(**OmegaConf.to_container(cfg.model, resolve=True))
    if getattr(dataset, "thinking", None) is not None and not spec.chat_template:
        raise ValueError(f"dataset.thinking={dataset.thinking} is the chat template's thinking switch "
                         f"(enable_thinking); set model.chat_template=true, or dataset.thinking=null")
    check_source(spec)  # config.json, GGUF header, remote code, offline Hub id: no weights read
    if cfg.batch_size > 1 and cfg.generation.get("num_beams", 1) > 1:
        raise ValueError("batch_size > 1 decodes greedily or by sampling; beam search (generation.num_beams > 1) "
                         "runs at batch_size=1")
    if getattr(dataset, "asks_follow_up", False) and cfg.generation.get("num_beams", 1) > 1:
        raise ValueError(f"dataset {dataset.name}: its second question (prompt=cot) is asked by the batched step, "
                         "which decodes greedily or by sampling; use generation.num_beams=1")
    from kvbench.engine.generation import Sampling

    Sampling(**OmegaConf.to_container(cfg.generation, resolve=True))  # e.g. num_beams with do_sample: fail here
    adapter = check_architecture(spec)  # an unsupported family fails here, from its config alone
    if adapter is not None:
        if cfg.positions == "shift":
            adapter.check_shift()
        if cfg.batch_size > 1 and (adapter.replaces is not None or adapter.has_window_layers
                                   or adapter.indexed_layers):
            raise ValueError(f"batch_size={cfg.batch_size}: {adapter.family} decodes at batch_size=1 only (attention "
                             "outside transformers' AttentionInterface, sliding-window layers, or a DSA "
                             "sparse-attention indexer)")
        check_feeding(cfg, method, dataset, adapter)
    if is_latent_model(spec):  # MLA: one latent per token for all heads (kvbench/methods/latent.py)
        check_latent(method)
        if cfg.positions == "shift":
            raise ValueError("MLA: positions=shift re-rotates cached keys, and an MLA cache holds latents beside a "
                             "shared rotary key the model rotates itself; use positions=original")
    check_query(cfg, method)
    if getattr(dataset, "turns", 1) > 1:  # a conversation feeds every later turn on top of the compressed cache
        check_query(cfg, method, why=f"dataset.turns={dataset.turns}")
    from kvbench.engine import recompress

    recompress.check(method, decode_compression(cfg), cfg.positions, cfg.generation.get("num_beams", 1),
                     getattr(dataset, "turns", 1))
    check_step(cfg, method, dataset, adapter)
    check_quantized(cfg, method)
    if not method.compresses:  # `full` ignores the budget: its records say so, and a sweep shares its run dir
        cfg.budget = cfg.ratio = None
    if cfg.ratio is None:
        method.check_budget(cfg.budget)
    elif method.threshold_budget:
        raise ValueError(f"{method.registry_name}: ratio={cfg.ratio} cannot be set: what a threshold method keeps is "
                         "an outcome of method.threshold (budget is ignored too); drop ratio")
    from kvbench.runs.shard import Shard

    Shard.parse(cfg.get("shard"))  # a bad `shard=` fails here, in one line
    return method, dataset, spec


def setup_remote(cfg: DictConfig, method, dataset):
    """`setup` for a run against an OpenAI-compatible server: its model node, and what it refuses (any method but
    `full`, beams, ...: kvbench.remote.spec), in one line before anything is sent."""
    from kvbench.remote.spec import RemoteSpec, check_remote, check_remote_dataset

    spec = RemoteSpec(**OmegaConf.to_container(cfg.model, resolve=True))
    check_remote(method, cfg)
    check_remote_dataset(dataset)
    if hasattr(dataset, "check"):  # its data folder
        dataset.check()
    cfg.budget = cfg.ratio = None  # `full`: the compression, if any, is the server's
    from kvbench.runs.shard import Shard

    Shard.parse(cfg.get("shard"))
    return method, dataset, spec


def build(node: DictConfig, what: str):
    """`node`'s `_target_` built with its fields; a failure (Hydra wraps the dataclass' ValueError in a multi-line
    message) as one line naming `what`."""
    from hydra.utils import instantiate

    try:
        return instantiate(node)
    except Exception as e:
        cause = e.__cause__ or e
        raise ValueError(f"{what}: {str(cause).splitlines()[0]}") from e


def method_node(name: str, model=None) -> DictConfig:
    """configs/method/<name>.yaml composed as a run composes its method: its `${model.<key>}` interpolations (KVzip's
    chat template, TailorKV's layer split) read `model` (the run's model node, or a configs/model file's fields),
    then resolved. Shared by a `then` method and the lm-eval harness's method, so neither reads other values."""
    path = CONFIG_DIR / "method" / f"{name}.yaml"
    if not path.is_file():
        from kvbench.registry import unknown_choice

        raise ValueError(unknown_choice("method", name, group_choices("method")))
    model = OmegaConf.to_container(model, resolve=True) if isinstance(model, DictConfig) else model or {}
    composed = OmegaConf.create({"model": model, "method": load_yaml(path)})
    return OmegaConf.create(OmegaConf.to_container(composed.method, resolve=True))


def build_method(node: DictConfig, build=build, model=None):
    """The method of a `method` node, wrapped by the kvpress-wrapper switches it carries (`+method.whole_layers=[0]`,
    `chunk_length`, `block_size`, `then` + `first_ratio`, `merge`: kvbench/methods/wrappers.py), unless they are its own
    fields (keydiff's `block_size`). `then` names a second method, built from its YAML composed with `model` (the
    run's model node: `method_node`), as the first method is."""
    import dataclasses

    from kvbench.methods.quantize import wrap_all
    from kvbench.methods.wrappers import Switches
    from kvbench.runs.schema import node_class

    cls = node_class(node)
    own = {f.name for f in dataclasses.fields(cls)} if cls is not None else set()
    keys = [f.name for f in dataclasses.fields(Switches) if f.name in node and f.name not in own]
    if not keys:
        return build(node, "method")
    values = OmegaConf.to_container(node, resolve=True)
    switches = Switches(**{key: values.pop(key) for key in keys})
    method = build(OmegaConf.create(values), "method")
    then = None
    if switches.then is not None:
        try:
            then_node = method_node(switches.then, model)
        except Exception as e:  # an unknown name, or a `${model.<key>}` the model lacks
            raise ValueError(f"method.then: {str(e).splitlines()[0]}") from None
        then = build(then_node, "method.then")
    try:
        return wrap_all(method, switches, then)
    except ValueError as e:
        raise ValueError(f"method: {e}") from None


def check_query(cfg: DictConfig, method, why: str | None = None) -> None:
    """What feeding tokens on top of a compressed cache (`query=agnostic`'s question, or `why`: a conversation's
    later turns) does not run with (`query`'s choices are kvbench/runs/schema.py's)."""
    if cfg.get("query", "aware") == "aware" and why is None:
        return
    if cfg.get("query", "aware") == "agnostic" and method.window_is_question:
        raise ValueError(f"query=agnostic: {method.registry_name}'s window is the question, which comes after the "
                         "compression there; use query=aware or a fixed method.window")
    why = why or "query=agnostic"
    if not method.takes_chunks:  # a storage method whose layers append one token per step (none at present)
        raise ValueError(f"{why}: {method.registry_name}'s layers take one token per step, not several on top of "
                         "the compressed cache (quest, pqcache and tailorkv do); use query=aware and one turn")
    if cfg.generation.get("num_beams", 1) > 1:
        raise ValueError(f"{why} runs at generation.num_beams=1 (beam search prefills the whole prompt)")


def check_quantized(cfg: DictConfig, method) -> None:
    """What a quantized store (`method=kivi`, `+method.quantize=kivi2`) does not run with: its keys are stored
    packed (nothing re-rotates them), and its layers are attended through `decode_kv` only."""
    if getattr(method, "kv_bits", None) is None:
        return
    name = method.registry_name
    if cfg.positions == "shift":
        raise ValueError(f"positions=shift: {name} stores its keys quantized, which are never re-rotated to their "
                         "slots; use positions=original")
    if cfg.generation.get("num_beams", 1) > 1:
        raise ValueError(f"generation.num_beams={cfg.generation.num_beams}: beam search reorders cache rows, which "
                         f"{name}'s quantized layers cannot; use num_beams=1")
    if cfg.get("step", "eager") != "eager":
        raise ValueError(f"step={cfg.step}: {name} keeps quantized layers, which the static step does not hold; use "
                         "step=eager (docs/throughput.md#the-static-step)")


def check_feeding(cfg: DictConfig, method, dataset, adapter) -> None:
    """Tokens prefilled on top of a compressed cache (`query=agnostic`'s question, a conversation's later turns) are
    attended by the capture without the model's ALiBi bias or sliding windows, and KVzip's reconstruction scores
    have no ALiBi bias: refuse those here, before weights load, instead of failing every sample."""
    from kvbench.methods.base import Kind

    turns = getattr(dataset, "turns", 1)
    feeds = "query=agnostic" if cfg.get("query", "aware") == "agnostic" else (
        f"dataset.turns={turns}" if turns > 1 else None)
    replays = method.kind is Kind.RECONSTRUCTOR and not method.scores_inputs  # (Fast KVzip replays nothing)
    if adapter.positions == "alibi" and (feeds or replays):
        raise ValueError(f"{feeds or 'method=' + method.registry_name}: {adapter.family} has ALiBi attention, which "
                         "tokens fed on top of a cache (an agnostic question, later turns, KVzip's reconstruction) "
                         "do not apply yet; use query=aware, one turn and another method")
    if adapter.indexed_layers and (feeds or replays):
        raise ValueError(f"{feeds or 'method=' + method.registry_name}: {adapter.family} has a DSA sparse-attention "
                         "indexer, whose top-k tokens fed on top of a compressed cache (an agnostic question, later "
                         "turns, KVzip's reconstruction) do not apply yet; use query=aware, one turn and another "
                         "method")
    if adapter.has_window_layers and feeds:
        raise ValueError(f"{feeds}: {adapter.family} has sliding-window layers, which tokens fed on top of a "
                         "compressed cache (an agnostic question, later turns) do not apply yet; use query=aware "
                         "and one turn")


def decode_compression(cfg: DictConfig):
    """The run's `decode_compression` node as kvbench.engine.recompress.DecodeCompression (off when absent)."""
    from kvbench.engine.recompress import DecodeCompression

    node = cfg.get("decode_compression")
    return DecodeCompression(**OmegaConf.to_container(node, resolve=True)) if node is not None else DecodeCompression()


def sample_budget(cfg: DictConfig, prompt_len: int) -> int | None:
    if cfg.ratio is not None:
        return max(1, int(prompt_len * (1 - cfg.ratio)))
    return cfg.budget


def sample_seed(cfg: DictConfig, sample) -> int:
    """Per-sample method randomness (Keyformer's noise): the run seed mixed with the sample id, order-free."""
    from kvbench.data.base import sha256_text

    return cfg.seed + int(sha256_text(sample.id)[:8], 16)


def check_step(cfg: DictConfig, method, dataset, adapter) -> None:
    """step=static / captured: what the static decode step cannot run is refused here, before weights load."""
    step = cfg.get("step", "eager")
    if step == "eager":
        return
    from kvbench.engine.static import unsupported

    reason = unsupported(method, cfg.positions, decode_compression(cfg).on, cfg.generation.get("num_beams", 1))
    if reason is None and getattr(dataset, "turns", 1) > 1:
        reason = f"a conversation (dataset.turns={dataset.turns}) feeds each turn on its cache"
    if reason is None and adapter is not None and (adapter.replaces is not None or adapter.has_window_layers):
        reason = f"{adapter.family}'s attention runs outside transformers' AttentionInterface or in sliding windows"
    if reason is not None:
        raise ValueError(f"step={step}: {reason}; use step=eager (docs/throughput.md#the-static-step)")

