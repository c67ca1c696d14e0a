"""Every option of every config group composes, instantiates and passes its rules (a typo'd field fails here, not in
a sweep); each of its values has a rule (kvbench/runs/schema.py; the other config files: test_schema.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from kvbench.models.loader import ModelSpec
from kvbench.remote.spec import RemoteSpec, is_remote
from kvbench.registry import METHODS
from kvbench.runs.config import CONFIG_DIR, group_choices
from kvbench.runs.schema import check, unruled

import kvbench.methods  # noqa: F401


@pytest.mark.parametrize("group", [pytest.param("method", marks=pytest.mark.registry), "dataset", "model"])
def test_every_group_option_composes_and_instantiates(group):
    for option in group_choices(group):
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = compose("config", overrides=[f"{group}={option}"] + (["model.path=x/y"] if option == "hf" else []))
        assert not unruled(cfg), f"{group}={option}: no rule for {unruled(cfg)} (kvbench/runs/schema.py RANGES)"
        check(cfg)  # the shipped values pass their own rules
        node = cfg[group]
        if group == "model":  # (model=openai: a server's node, kvbench.remote)
            (RemoteSpec if is_remote(node) else ModelSpec)(**OmegaConf.to_container(node, resolve=True))
        else:
            obj = instantiate(node)
            if group == "method":
                obj.check_budget(cfg.budget)


@pytest.mark.registry
def test_every_registered_method_has_a_yaml_and_back():
    assert set(METHODS.names()) == set(group_choices("method"))


@pytest.mark.registry
def test_method_yaml_mirrors_the_dataclass_fields():
    import dataclasses

    for name in METHODS.names():
        yaml_fields = set(OmegaConf.load(Path(CONFIG_DIR) / "method" / f"{name}.yaml")) - {"_target_"}
        assert yaml_fields == {f.name for f in dataclasses.fields(METHODS[name])}, name


def test_model_dataset_specialization_applies_only_to_its_pair():
    from kvbench.data.niah import PYRAMIDKV_QUESTION, PYRAMIDKV_TEMPLATE

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        embedded = compose("config")  # smollm2 x niah: the answer-prefix prompt
        tiny = compose("config", overrides=["model=tiny_llama"])
        exact = compose("config", overrides=["~model_dataset"])
    assert embedded.dataset.template.endswith("Answer: The best thing to do in San Francisco is")
    assert tiny.dataset.template == exact.dataset.template == PYRAMIDKV_TEMPLATE
    assert tiny.dataset.retrieval_question == PYRAMIDKV_QUESTION
