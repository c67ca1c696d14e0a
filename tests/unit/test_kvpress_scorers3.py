"""kvbench's kept sets equal kvpress 0.5.5's for KVComposePress (both variants) and KVgradPress, on the embedded
SmolLM2 (tests/fixtures/kvpress_scorers3/goldens.json, made by scripts/make_kvpress_goldens_scorers3.py). The suite
compares the first golden prompt (160 tokens: one prefill, one replay, one backward on the CPU); the second (240)
was equal too for all three cases when checked by hand. KVCompose's two variants select from one replay's scores."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import kvbench.methods  # noqa: F401
from kvbench.cache import KVCache
from kvbench.engine.generation import compress, prefill, reconstruct
from kvbench.models import AttentionCapture, ModelSpec, load
from kvbench.registry import METHODS
from tests.unit.test_kvzip import kept_positions

GOLDENS = Path(__file__).resolve().parents[1] / "fixtures/kvpress_scorers3/goldens.json"


def as_masks(heads) -> list[int]:
    return [sum(1 << j for j in h.tolist()) for h in heads]


@pytest.fixture(scope="module")
def embedded():
    """The goldens, the model and tokenizer, the first golden prompt's prefilled cache and KVCompose's replay
    scores on it (both variants score alike: they differ in the selection)."""
    goldens = json.loads(GOLDENS.read_text())
    model, tokenizer = load(ModelSpec(name="smollm2", path="embedded"))
    golden = goldens["prompts"][0]
    cache, ids = KVCache(), torch.tensor([golden["ids"]])
    with AttentionCapture(model) as capture:
        prefill(model, ids, cache)
        reconstruct(model, METHODS["kvcompose"](), capture, cache.clone(), ids, golden["budget"])
        scores = capture.key_scores
    return goldens, model, tokenizer, cache, scores


@pytest.mark.parametrize("case", ["kvcompose", "kvcompose_unstructured"])
def test_kvcompose_keeps_kvpress_sets(case, embedded):
    goldens, *_, scores = embedded
    golden = goldens["cases"][case]
    method = METHODS[golden["method"]](**golden["fields"])
    kept = method.select_all(scores, goldens["prompts"][0]["budget"])
    for i, heads in enumerate(golden["kept"][0]):
        assert as_masks(kept[i][0] if method.structured else kept[i]) == [int(h, 16) for h in heads], (case, i)


def test_kvgrad_keeps_kvpress_sets(embedded):
    goldens, model, tokenizer, prefilled, _ = embedded
    golden = goldens["cases"]["kvgrad"]
    method = METHODS[golden["method"]](**golden["fields"])
    method.prepare(model, tokenizer)
    prompt_golden, cache, layers = goldens["prompts"][0], prefilled.clone(), golden["kept"][0]
    ids = torch.tensor([prompt_golden["ids"]])
    with AttentionCapture(model) as capture:
        reconstruct(model, method, capture, cache, ids, prompt_golden["budget"])
        compress(method, cache, capture, prompt_golden["budget"])
    for layer, heads in zip(cache.layers, layers):
        assert [sum(1 << j for j in h) for h in kept_positions(layer)] == [int(h, 16) for h in heads]
