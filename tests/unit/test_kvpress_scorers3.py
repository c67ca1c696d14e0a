"""kvbench's kept sets equal kvpress 0.5.5's for KVComposePress (both variants) and KVgradPress, on the embedded
SmolLM2 (tests/fixtures/kvpress_scorers3/goldens.json, made by scripts/make_kvpress_goldens_scorers3.py). One model
load and one prefill per prompt serve every case: KVCompose's two variants select from one replay's scores; KVgrad
(a forward and a backward per chunk on the CPU) runs on the first prompt only (both were equal when checked by hand)."""
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
    """The goldens, the model and tokenizer, each golden prompt's prefilled cache and KVCompose's replay scores
    (both variants score alike: they differ in the selection)."""
    goldens = json.loads(GOLDENS.read_text())
    model, tokenizer = load(ModelSpec(name="smollm2", path="embedded"))
    caches, scores = [], []
    with AttentionCapture(model) as capture:
        for golden in goldens["prompts"]:
            cache, ids = KVCache(), torch.tensor([golden["ids"]])
            prefill(model, ids, cache)
            caches.append(cache)
            reconstruct(model, METHODS["kvcompose"](), capture, cache.clone(), ids, golden["budget"])
            scores.append(capture.key_scores)
    return goldens, model, tokenizer, caches, scores


@pytest.mark.parametrize("case", ["kvcompose", "kvcompose_unstructured"])
def test_kvcompose_keeps_kvpress_sets(case, embedded):
    goldens, *_, scores = embedded
    golden = goldens["cases"][case]
    method = METHODS[golden["method"]](**golden["fields"])
    for prompt_golden, layer_scores, layers in zip(goldens["prompts"], scores, golden["kept"]):
        kept = method.select_all(layer_scores, prompt_golden["budget"])
        for i, heads in enumerate(layers):
            assert as_masks(kept[i][0] if method.structured else kept[i]) == [int(h, 16) for h in heads], (case, i)


def test_kvgrad_keeps_kvpress_sets(embedded):
    goldens, model, tokenizer, caches, _ = embedded
    golden = goldens["cases"]["kvgrad"]
    method = METHODS[golden["method"]](**golden["fields"])
    method.prepare(model, tokenizer)
    prompt_golden, cache, layers = goldens["prompts"][0], caches[0].clone(), golden["kept"][0]
    ids = torch.tensor([prompt_golden["ids"]])
    with AttentionCapture(model) as capture:
        reconstruct(model, method, capture, cache, ids, prompt_golden["budget"])
        compress(method, cache, capture, prompt_golden["budget"])
    for layer, heads in zip(cache.layers, layers):
        assert [sum(1 << j for j in h) for h in kept_positions(layer)] == [int(h, 16) for h in heads]
