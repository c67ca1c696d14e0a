"""Every config value has a rule (kvbench/runs/schema.py), and `setup` refuses what each rule excludes, in one line.

A new field of a config class, or a new key in a config file, without a rule fails here; so does a rule whose bad
values get through, including the ones it leaves to a class's `__post_init__` (`OWN`). The group options are walked
in test_configs.py (it composes each of them already); the paper presets and per-paper method settings here.
"""
from __future__ import annotations

import copy
import json

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf, open_dict

import kvbench.data  # noqa: F401  (registers the datasets)
import kvbench.methods  # noqa: F401
from kvbench.registry import DATASETS, METHODS
from kvbench.runs.config import CONFIG_DIR, group_choices, setup
from kvbench.methods import Method
from kvbench.runs import rules
from kvbench.runs.rules import SNAPSHOT, check_early
from kvbench.runs.schema import NODES, Rule, Run, method_rules, node_class, rules_of, snapshot
from kvbench.serving.spec import ServingSpec
from kvbench.serving.spec import presets as serving_presets

ABSENT = object()
CLASSES = [Run, *NODES.values(), *(METHODS[n] for n in METHODS.names()), *(DATASETS[n] for n in DATASETS.names())]


@pytest.mark.registry
def test_every_field_of_every_config_class_has_a_rule():
    """Numbers, text and untyped values need an entry in RANGES (bools and Literals are complete as annotated)."""
    missing = [f"{cls.__name__}.{name}" for cls in CLASSES for name, rule in rules_of(cls).items() if rule is None]
    assert not missing, f"add these to kvbench/runs/schema.py RANGES: {missing}"


def option_class(group: str, option: str) -> type:
    """The class an option of the method or dataset group builds (one without `_target_` extends another)."""
    raw = OmegaConf.load(CONFIG_DIR / group / f"{option}.yaml")
    if "_target_" in raw:
        return node_class(raw)
    return option_class(group, next(e for e in raw.defaults if e != "_self_"))


def preset_option(preset: str, group: str) -> str:
    """The option of `group` a paper preset runs: its `override /<group>`, else its parent preset's, else the
    default of configs/config.yaml."""
    defaults = OmegaConf.load(CONFIG_DIR / "paper" / f"{preset}.yaml").get("defaults", [])
    for entry in defaults:
        if isinstance(entry, DictConfig) and f"override /{group}" in entry:
            return entry[f"override /{group}"]
    parents = [e for e in defaults if isinstance(e, str) and (CONFIG_DIR / "paper" / f"{e}.yaml").is_file()]
    if parents:
        return preset_option(parents[0], group)
    return next(e[group] for e in OmegaConf.load(CONFIG_DIR / "config.yaml").defaults if group in e)


def assert_ruled(where: str, cls: type, values: dict) -> None:
    rules = method_rules(cls) if issubclass(cls, Method) else rules_of(cls)  # (+ the wrapper switches)
    for key, value in values.items():
        assert rules.get(key) is not None, f"{where}: {key} has no rule ({cls.__name__}); see kvbench/runs/schema.py"
        if isinstance(value, str) and value.startswith("${"):
            continue  # an interpolation (`${budget}`): its value is checked in each composed job (validate)
        assert rules[key].problem(value) is None, f"{where}: {key}={value!r} {rules[key].problem(value)}"


def test_every_config_file_is_ruled_and_passes_its_rules():
    """Each YAML under configs/: config.yaml and the group options as composed (test_configs.py composes each option
    and checks it); paper presets, their settings, per-paper method settings and pair specializations as written,
    each key against the class it fills. Composing the 50 presets would cost ~8 s."""
    checked = {"config.yaml", "method", "dataset", "model", "hydra"}  # composed in test_configs.py; hydra: Hydra's
    assert {p.name for p in CONFIG_DIR.iterdir()} - checked == {"paper", "paper_method", "paper_settings",
                                                                 "model_dataset", "serving"}, \
        "a new config folder: check it here"
    for name in serving_presets():  # the load benchmark's settings (python -m kvbench.serving)
        assert_ruled(f"serving/{name}", ServingSpec, OmegaConf.to_container(OmegaConf.load(
            CONFIG_DIR / "serving" / f"{name}.yaml")))
    methods = sorted(group_choices("method"), key=len, reverse=True)  # pyramidkv_niah_h2o: h2o, not a prefix
    datasets = sorted(group_choices("dataset"), key=len, reverse=True)
    for name in group_choices("paper_method"):  # `# @package method`: that method's fields
        method = next(m for m in methods if name.endswith("_" + m))
        assert_ruled(f"paper_method/{name}", METHODS[method], OmegaConf.to_container(OmegaConf.load(
            CONFIG_DIR / "paper_method" / f"{name}.yaml")))
    for name in group_choices("paper_settings"):  # the manifest's paper block
        assert_ruled(f"paper_settings/{name}", Run, {"paper_settings": dict(OmegaConf.load(
            CONFIG_DIR / "paper_settings" / f"{name}.yaml"))})
    for group, option_of in (("paper", preset_option),
                             ("model_dataset", lambda name, _: next(d for d in datasets if name.endswith("_" + d)))):
        for name in group_choices(group):  # `# @package _global_`
            raw = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / group / f"{name}.yaml"))
            nodes = {**NODES, "dataset": option_class("dataset", option_of(name, "dataset"))}
            assert "method" not in raw, f"{group}/{name}: method settings belong in paper_method/"
            for key, value in raw.items():
                if key in nodes:
                    assert_ruled(f"{group}/{name}", nodes[key], value)
                elif key not in ("defaults", "hydra"):
                    assert_ruled(f"{group}/{name}", Run, {key: value})


def bad_values(rule: Rule) -> list:
    """Values `rule` says are out: another type, each side of its range, a choice it lacks, null; for a rule left to
    a class, a value no class takes (-1000000, an unknown name)."""
    r = rule.range
    items = {int: ["abc", 1.5, True], float: ["abc", True], bool: ["maybe", 1], str: [7], None: []}[rule.kind]
    if r.choices:
        items.append("no-such-choice" if rule.kind is str else max(r.choices) + 1)
    elif r.owner:
        items.append(-1000000 if rule.kind in (int, float) else "no-such-choice")
    else:
        if r.low is not None:
            items.append(r.low if r.open_low else r.low - 1)
        if r.high is not None:
            items.append(r.high if r.open_high else r.high + 1)
    values = [[item] for item in items] + ["abc"] if rule.many else items
    return values + ([] if rule.null else [None])


@pytest.fixture(scope="module")
def base() -> DictConfig:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("config", overrides=["model=tiny_llama"])


def configs_of(base: DictConfig):
    """(class, config, key of its node or None for the top level): one config per class, from its own option file."""
    yield Run, base, None
    for key, cls in NODES.items():  # generation, model, decode_compression
        yield cls, base, key
    for group, registry in (("method", METHODS), ("dataset", DATASETS)):
        for cls in (registry[n] for n in registry.names()):
            option = next(o for o in group_choices(group) if OmegaConf.load(CONFIG_DIR / group / f"{o}.yaml").get(
                "_target_") == f"{cls.__module__}.{cls.__name__}")
            cfg = copy.deepcopy(base)
            with open_dict(cfg):
                cfg[group] = OmegaConf.load(CONFIG_DIR / group / f"{option}.yaml")
            yield cls, cfg, group


def test_setup_refuses_each_rules_bad_values_in_one_line_naming_key_and_value(base):
    """Through `setup` (what the run, validate, the grid launcher and merge call), one bad value at a time; the
    message names the field and shows the value."""
    probes = refused_early = 0
    for cls, cfg, group in configs_of(base):
        node = cfg[group] if group else cfg
        for name, rule in rules_of(cls).items():
            good = node[name] if name in node else ABSENT
            for bad in bad_values(rule):
                with open_dict(node):
                    node[name] = bad
                with pytest.raises(ValueError) as error:
                    setup(cfg)
                line, shown = str(error.value), bad[0] if isinstance(bad, list) else bad
                early = refusal(check_early, cfg)
                assert early in (None, line), (cls.__name__, name, bad, early, line)  # the same line, or setup's
                refused_early += early is not None
                assert "\n" not in line and name.rstrip("s") in line, (cls.__name__, name, bad, line)
                assert repr(shown) in line or str(shown) in line, (cls.__name__, name, bad, line)
                probes += 1
            with open_dict(node):
                node.pop(name, None) if good is ABSENT else node.__setitem__(name, good)
    assert probes > 600  # every field of every class above
    assert refused_early > 0.8 * probes  # before torch (rules.json); the rest: values a class's own code judges


def refusal(check, cfg) -> str | None:
    try:
        check(cfg)
    except ValueError as e:
        return str(e)
    return None


def test_rules_json_is_what_the_classes_say():
    """kvbench/runs/rules.json, which judges values before torch is imported, holds every built-in class's rules
    as they are now (after changing a config class or RANGES: python -m kvbench.runs.schema)."""
    assert json.loads(SNAPSHOT.read_text()) == json.loads(json.dumps(snapshot())), \
        "kvbench/runs/rules.json is out of date: run python -m kvbench.runs.schema"


def test_a_class_changed_since_rules_json_is_left_to_setup(base):
    """A source file whose hash is not rules.json's sets its classes aside: the early check refuses nothing it
    might now allow (setup still judges the value)."""
    cfg = copy.deepcopy(base)
    cfg.limit = 0
    target = "kvbench.runs.schema.Run"
    assert "limit=0" in refusal(check_early, cfg)
    sources = rules.snapshot()["classes"][target]["sources"]
    saved = dict(sources)
    try:
        sources["runs/schema.py"] = "0" * 16
        rules.current.cache_clear()
        assert rules.current(target) is None and refusal(check_early, cfg) is None
    finally:
        sources.update(saved)
        rules.current.cache_clear()
    assert rules.current(target) is not None
