"""A new method added by the docs alone passes the registry-wide tests with no edit to any of them.

The worked example of docs/adding_a_method.md is executed as written (so the page cannot drift from the API),
registered with its YAML for this test only, and handed to the very tests that walk the registry: the contract, every
model family, half precision, batch N = batch 1, and the batch mixing every registered method (one sample more than
the registry held when its lengths were written by hand). The docs' targeted command selects exactly those tests.
"""
from __future__ import annotations

import dataclasses
import re
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import kvbench.methods  # noqa: F401
from kvbench.registry import METHODS
from kvbench.runs.config import CONFIG_DIR
from kvbench.runs.schema import rules_of
from tests.unit import test_batching, test_contract, test_dtypes, test_families
from tests.unit.tiny import tiny_model

DOC = Path(__file__).resolve().parents[2] / "docs" / "adding_a_method.md"
NAME = "peak_attention"


def example_block(language: str) -> str:
    """The first `language` code block of the page's worked example."""
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("## A worked example"):]
    return re.search(rf"```{language}\n(.*?)```", section, re.DOTALL).group(1)


@pytest.fixture
def example(monkeypatch, tmp_path):
    """The example as the module `kvbench.methods.peak_attention`, registered, with its YAML beside copies of the
    shipped ones (what the tests' `configured` reads); the registry, modules and config folder are restored after."""
    monkeypatch.setattr(METHODS, "_items", {k: v for k, v in METHODS._items.items() if k != NAME})  # (if shipped)
    module = types.ModuleType(f"kvbench.methods.{NAME}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(kvbench.methods, NAME, module, raising=False)  # (where `_target_` is looked up first)
    exec(compile(example_block("python"), str(DOC), "exec"), module.__dict__)
    shutil.copytree(CONFIG_DIR / "method", tmp_path / "method")
    (tmp_path / "method" / f"{NAME}.yaml").write_text(example_block("yaml"), encoding="utf-8")
    for test_module in (test_contract, test_families):  # (each has its own `configured`)
        monkeypatch.setattr(test_module, "CONFIG_DIR", tmp_path)
    return METHODS[NAME]


def test_the_docs_example_passes_every_registry_wide_test(example, monkeypatch):
    assert type(test_contract.configured(NAME)) is example and NAME in METHODS.names()
    test_contract.test_method_declares_what_it_is(NAME)
    for family in ("llama", "mistral", "qwen2"):
        test_contract.test_method_contract(NAME, family)
    for family in ("llama", "mpt", "gemma2"):  # (ALiBi and the soft cap reach its scores through the view)
        test_families.check_contract(family, NAME)
    test_dtypes.test_method_runs_in_half_precision(NAME, (tiny_model("llama", layers=2).to(torch.bfloat16),
                                                          torch.bfloat16))
    test_batching.test_batch_n_equals_batch_1(NAME)
    assert len(METHODS.names()) + 1 > 19  # the mixed batch below outgrows the 19 lengths once written by hand
    test_batching.test_a_batch_mixing_every_method_equals_each_alone(monkeypatch)
    yaml = OmegaConf.create(example_block("yaml"))  # what test_configs checks of every shipped YAML
    assert set(yaml) - {"_target_"} == {f.name for f in dataclasses.fields(example)}
    assert all(rule is not None for rule in rules_of(example).values())  # test_schema: every field has a rule


def test_the_docs_example_selects_what_it_says(example):
    """Independent of the helpers: per KV head, the prefix entries with the highest peak softmax weight from any of
    the last `window` queries of its group, plus the window, from an explicit softmax over the full logits."""
    from kvbench.methods.base import LayerView

    g = torch.Generator().manual_seed(0)
    n, w, n_keep = 40, 4, 12
    keys, queries = torch.randn(1, 2, n, 8, generator=g), torch.randn(1, 6, w, 8, generator=g)
    view = LayerView(0, 1, keys, torch.randn(1, 2, n, 8, generator=g), queries, 8 ** -0.5)
    logits = torch.einsum("bhqd,bhkd->bhqk", queries, keys.repeat_interleave(3, dim=1)) * 8 ** -0.5
    causal = torch.arange(n)[None, :] > torch.arange(n - w, n)[:, None]
    weights = logits.masked_fill(causal, float("-inf")).softmax(dim=-1)  # [1, 6, w, n]
    peak = weights[0, :, :, : n - w].amax(dim=1).view(2, 3, n - w).amax(dim=1)  # [2, n - w]
    expected = [sorted(peak[h].topk(n_keep - w).indices.tolist()) + list(range(n - w, n)) for h in range(2)]
    assert example(window=w).select(view, n_keep)[0].tolist() == expected

