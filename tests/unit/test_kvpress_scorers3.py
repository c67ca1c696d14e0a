"""kvbench's kept sets equal kvpress 0.5.5's for KVComposePress (both variants; on what float rounding cannot flip,
tests/unit/decidable.py) and KVgradPress (exactly: its gradient scores are not recomputed here), on the embedded
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
from kvbench.methods.kvcompose import aggregate
from kvbench.registry import METHODS
from tests.unit.decidable import mask, topk_disagreements
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


def kvcompose_disagreements(method, scores: dict, kept: dict, golden_layers: list) -> list[str]:
    """KVCompose's kept sets against kvpress's on what float rounding cannot flip (tests/unit/decidable.py), with
    kvbench's own scores as `select_all` forms them: unstructured, one top-k over every head's entries (each head's
    first `keep_token_lower_bound` ranks forced); structured, the layers' counts from one top-k over the layers'
    composite curves, then each head's own top-count in every layer whose count both agree on."""
    stacked = torch.stack([scores[i][0] for i in sorted(scores)]).float()
    if method.add_mean_across_heads:
        stacked = stacked + stacked.mean(dim=1, keepdim=True)
    n_layers, n_heads, n = stacked.shape
    theirs = torch.tensor([[[bool(int(h, 16) >> j & 1) for j in range(n)] for h in heads] for heads in golden_layers])
    ours = torch.stack([torch.stack([mask(h.tolist(), n) for h in (kept[i][0] if method.structured else kept[i])])
                        for i in sorted(scores)])
    ranks = stacked.argsort(dim=-1, descending=True).argsort(dim=-1)  # each entry's rank in its head
    forced = stacked.double().masked_fill(ranks < method.keep_token_lower_bound, float("inf"))
    if not method.structured:
        return topk_disagreements(forced, ours, theirs, "every layer and head")
    curves = aggregate(stacked.sort(dim=-1, descending=True).values, 1, method.agg_head).double()  # [L, n]
    curves[:, :method.keep_token_lower_bound] += 1e9
    curves[0] = curves.max(dim=0).values
    by_rank = torch.arange(n)[None]
    count_ours, count_theirs = ours[:, 0].sum(-1), theirs[:, 0].sum(-1)
    problems = topk_disagreements(curves, by_rank < count_ours[:, None], by_rank < count_theirs[:, None],
                                  "the layers' counts")
    for layer in range(n_layers):
        if count_ours[layer] == count_theirs[layer]:
            problems += [p for h in range(n_heads) for p in topk_disagreements(
                forced[layer, h], ours[layer, h], theirs[layer, h], f"layer {layer} head {h}")]
    return problems


@pytest.mark.parametrize("case", ["kvcompose", "kvcompose_unstructured"])
def test_kvcompose_keeps_kvpress_sets(case, embedded):
    goldens, *_, scores = embedded
    golden = goldens["cases"][case]
    method = METHODS[golden["method"]](**golden["fields"])
    kept = method.select_all(scores, goldens["prompts"][0]["budget"])
    assert not kvcompose_disagreements(method, scores, kept, golden["kept"][0])


@pytest.mark.parametrize("case", ["kvcompose", "kvcompose_unstructured"])
def test_a_real_kvcompose_difference_still_fails(case, embedded):
    """One head's clearly kept entry swapped for a clearly evicted one in kvpress's golden is reported."""
    goldens, *_, scores = embedded
    golden = goldens["cases"][case]
    method = METHODS[golden["method"]](**golden["fields"])
    kept = method.select_all(scores, goldens["prompts"][0]["budget"])
    layers = [list(heads) for heads in golden["kept"][0]]
    n = scores[sorted(scores)[0]].shape[-1]
    layer = scores[sorted(scores)[1]][0].float()  # layer 1 (layer 0 takes the largest count), head 0, as ranked
    row = layer[0] + layer.mean(dim=0) if method.add_mean_across_heads else layer[0]
    held = [j for j in range(n) if int(layers[1][0], 16) >> j & 1]
    out = [j for j in range(n) if not int(layers[1][0], 16) >> j & 1]
    best, worst = max(held, key=lambda j: row[j]), min(out, key=lambda j: row[j])
    layers[1][0] = hex(int(layers[1][0], 16) - (1 << best) + (1 << worst))
    assert kvcompose_disagreements(method, scores, kept, layers)


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
