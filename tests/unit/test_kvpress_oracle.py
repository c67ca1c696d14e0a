"""kvbench's methods against kvpress 0.5.5 itself: the entries each press keeps per layer and KV head, on the embedded
model, 2 prompts and 2-3 ratios (tests/fixtures/kvpress, made by scripts/make_kvpress_goldens.py in kvpress's venv).

Each method runs with kvpress's defaults set (ratio r -> budget int(n (1 - r)), as kvpress's n_kept) through the
engine (`prepare` on one shared prefill per prompt, as the grid launcher runs it). Ties: a top-k scorer's rows
(SnapKV, PyramidKV, Knorm, Expected Attention; KVzip's one cut over every layer and head) are compared with
kvbench's own scores on what float rounding cannot flip (tests/unit/decidable.py: entries within 1e-4 of the cut
are a tie, compared by count), so the comparison holds on any x86 CPU; the other readings (StreamingLLM's positions,
Ada-KV's allocation, the evictors TOVA and observed attention) by the golden's list of rows whose kvpress cut fell
between equal scores (count only there), exact elsewhere. Where kvbench's default reading differs from kvpress, a
test shows that it does.
"""
from __future__ import annotations

import base64
import json
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

import kvbench.methods  # noqa: F401
from kvbench.cache.kv_cache import KVCache
from kvbench.cache.varlen import VarlenLayer
from kvbench.engine.generation import Prefilled, compress, prefill, prepare, reconstruct
from kvbench.models import AttentionCapture, ModelSpec, load
from kvbench.methods.base import LayerView
from kvbench.registry import METHODS
from tests.unit.decidable import mask, topk_disagreements

GOLDENS = Path(__file__).resolve().parents[1] / "fixtures" / "kvpress"
ALL_QUERIES = 4096  # Expected Attention's window: every prompt query, as kvpress takes its statistics

# golden file -> (kvbench method, the settings that make it kvpress's press)
KVPRESS_READINGS = {
    "snapkv": ("snapkv", dict(window=64, kernel=5, pooling="avg")),
    "streamingllm": ("streamingllm", dict(n_sink=4)),
    "tova": ("tova", dict(keep_last=True)),
    "knorm": ("knorm", dict()),
    "expected_attention": ("expected_attention", dict(window=ALL_QUERIES)),
    "adakv": ("adakv", dict(window=64, kernel=5, pooling="avg", allocation="kvpress", alpha=0.2)),
    "pyramidkv": ("pyramidkv", dict(window=4, kernel=5, pooling="avg", schedule="kvpress")),
    "kvzip": ("kvzip", dict(sinks="repeated", chunk_size=2048)),
    "observed_attention": ("h2o", dict(variant="prefill_only", recent_size=0, normalize="observed")),
}
# the same without the kvpress switch: the default reading, which must differ somewhere (prompt 0)
DEFAULT_READINGS = {
    "pyramidkv": ("pyramidkv", dict(window=4, kernel=5, pooling="avg")),
    "observed_attention": ("h2o", dict(variant="prefill_only", recent_size=0)),
    "expected_attention": ("expected_attention", dict()),
}
SCORERS = {"h2o": "softmax", "tova": "last_row"}  # column scorers shared by one prefill: name per method
TOP_K = ("snapkv", "pyramidkv", "knorm", "expected_attention")  # one top-k per (layer, head) row of `scores(view)`


def golden(name: str) -> dict:
    return json.loads((GOLDENS / f"{name}.json").read_text())


def golden_kept(layer_b64: str, heads: int, n: int) -> list[set[int]]:
    bits = np.unpackbits(np.frombuffer(base64.b64decode(layer_b64), dtype=np.uint8), bitorder="little")
    return [set(np.flatnonzero(row).tolist()) for row in bits[: heads * n].reshape(heads, n)]


def row_scores(method, views: list[LayerView], n: int) -> torch.Tensor:
    """kvbench's own scores `[L, H_kv, n]` of a top-k reading, +inf where entries are kept whatever they score (a
    window after the scored prefix, Knorm's recent entries)."""
    layers = []
    for view in views:
        scores = method.scores(view)[0].double()
        if getattr(method, "recent", 0):
            scores = scores[:, : n - method.recent]
        layers.append(torch.cat([scores, scores.new_full((scores.shape[0], n - scores.shape[1]), float("inf"))], 1))
    return torch.stack(layers)


def kept_positions(cache: KVCache) -> list[list[set[int]]]:
    """Per layer, per KV head: the original positions the compressed cache holds."""
    out = []
    for layer in cache.layers:
        if isinstance(layer, VarlenLayer):
            heads = layer.flat_positions.split(layer.head_lens.tolist())
        else:
            heads = list(layer.positions[0])
        out.append([set(h.tolist()) for h in heads])
    return out


@pytest.fixture(scope="module")
def oracle():
    """Every reading's kept positions, by (reading, prompt, ratio): per prompt one shared prefill, of which each
    method's `prepare` compresses a copy (KVzip: one reconstruction per prompt, then one compression per ratio)."""
    model, tokenizer = load(ModelSpec(name="smollm2", path="embedded"))
    prompts = json.loads((GOLDENS / "prompts.json").read_text())["ids"]
    readings = {**KVPRESS_READINGS, **{f"default {k}": v for k, v in DEFAULT_READINGS.items()}}
    methods = {name: METHODS[method](**kwargs) for name, (method, kwargs) in readings.items()}
    methods["kvzip"].prepare(model, tokenizer)  # (tokenizes its reconstruction prompts)
    ratios = {name: sorted({c["ratio"] for c in golden(name)["cases"]}) for name in KVPRESS_READINGS}
    runs: dict[tuple[str, int, float], list[list[set[int]]]] = {}
    scores: dict[tuple[str, int], torch.Tensor] = {}  # kvbench's own, per top-k reading and prompt
    with AttentionCapture(model) as capture:
        for p, ids in enumerate(prompts):
            ids = torch.tensor([ids])
            n = ids.shape[1]
            capture.reset()
            capture.window = max(m.query_window for m in methods.values())
            capture.column_scores["softmax"] = lambda logits: logits.softmax(dim=-1)  # H2O's row score
            capture.column_scores["last_row"] = partial(methods["tova"].row_score, state=None, decoding=False)
            cache = KVCache()
            logits = prefill(model, ids, cache)
            seen = dict(capture.window_queries), dict(capture.window_bias), dict(capture.scaling)
            sums = capture.named_column_sums
            views = [LayerView(i, len(cache.layers), layer.keys, layer.values, capture.window_queries.get(i),
                               capture.scaling.get(i, 1.0), capture.window_bias.get(i), capture.softcap.get(i),
                               capture.rotary.get(i)) for i, layer in enumerate(cache.layers)]
            for name in TOP_K:
                scores[name, p] = row_scores(methods[name], views, n)
            for name, method in methods.items():
                if name == "kvzip" or name.startswith("default") and p > 0:
                    continue
                for ratio in ratios[name.removeprefix("default ")]:
                    budget = max(1, int(n * (1 - ratio)))
                    scorer = SCORERS.get(method.registry_name)
                    state = method.start(n, budget, 1, 0) if scorer else None
                    shared = Prefilled(cache, logits, 0.0, state, *seen, sums.get(scorer, {}))
                    runs[name, p, ratio] = kept_positions(prepare(model, method, capture, ids, budget, 1,
                                                                  prefilled=shared).cache)
            capture.reset()
            budgets = {ratio: max(1, int(n * (1 - ratio))) for ratio in ratios["kvzip"]}
            reconstruct(model, methods["kvzip"], capture, cache, ids, min(budgets.values()))
            key_scores = capture.key_scores
            scores["kvzip", p] = torch.stack([key_scores[i][0] for i in sorted(key_scores)]).double()
            scores["kvzip", p][..., :methods["kvzip"].n_sink] = float("inf")
            for ratio, budget in budgets.items():
                compressed = cache.clone()
                capture.key_scores = key_scores
                compress(methods["kvzip"], compressed, capture, budget)
                runs["kvzip", p, ratio] = kept_positions(compressed)
            capture.reset()
    return runs, {name: golden(name) for name in KVPRESS_READINGS}, model.config, prompts, scores


def masks(heads: list[set[int]], n: int) -> torch.Tensor:
    return torch.stack([mask(h, n) for h in heads])


def mismatches(kept: list[list[set[int]]], case: dict, n: int, scores: torch.Tensor | None = None,
               one_cut: bool = False) -> list[str]:
    """Rows where kvbench keeps other positions than kvpress. With kvbench's `scores` `[L, H_kv, n]`: on the entries
    rounding cannot flip, a tie compared by count per row (`one_cut`: over every row at once, KVzip); without: a row
    the golden lists as tied by count only, every other row exactly."""
    if scores is not None:
        ours = torch.stack([masks(heads, n) for heads in kept])
        theirs = torch.stack([masks(golden_kept(b64, len(heads), n), n) for heads, b64 in zip(kept, case["kept"])])
        if one_cut:
            return topk_disagreements(scores, ours, theirs, "every layer and head")
        return [problem for layer in range(len(kept)) for head in range(len(kept[layer]))
                for problem in topk_disagreements(scores[layer, head], ours[layer, head], theirs[layer, head],
                                                  f"layer {layer} head {head}")]
    tied = {tuple(row) for row in case["tied"]}
    wrong = []
    for layer, (ours, layer_b64) in enumerate(zip(kept, case["kept"])):
        for head, (mine, theirs) in enumerate(zip(ours, golden_kept(layer_b64, len(ours), n))):
            if (layer, head) in tied and len(mine) == len(theirs):
                continue
            if mine != theirs:
                wrong.append(f"layer {layer} head {head}: +{sorted(mine - theirs)[:5]} -{sorted(theirs - mine)[:5]}")
    return wrong


@pytest.mark.parametrize("name", list(KVPRESS_READINGS))
def test_kvbench_keeps_what_kvpress_keeps(oracle, name):
    runs, goldens, config, prompts, scores = oracle
    cases = goldens[name]["cases"]
    assert len(cases) >= 4 and goldens[name]["kvpress"] == "0.5.5"
    for case in cases:
        kept = runs[name, case["prompt"], case["ratio"]]
        assert len(kept) == config.num_hidden_layers and all(len(h) == config.num_key_value_heads for h in kept)
        wrong = mismatches(kept, case, len(prompts[case["prompt"]]), scores.get((name, case["prompt"])),
                           one_cut=name == "kvzip")
        assert not wrong, (f"{name}, prompt {case['prompt']}, ratio {case['ratio']}: {len(wrong)} rows differ, "
                           f"e.g. {wrong[:3]}")


@pytest.mark.parametrize("name", ["snapkv", "kvzip"])
def test_a_real_difference_from_kvpress_still_fails(oracle, name):
    """kvpress's golden with one clearly kept entry swapped for a clearly evicted one of the same row (the count
    unchanged) is reported, though the rows are compared with ties allowed."""
    runs, goldens, config, prompts, scores = oracle
    case = goldens[name]["cases"][0]
    n, heads = len(prompts[case["prompt"]]), config.num_key_value_heads
    kept, own = runs[name, case["prompt"], case["ratio"]], scores[name, case["prompt"]]
    theirs = torch.stack([masks(golden_kept(b64, heads, n), n) for b64 in case["kept"]])
    layer, head = next((l, h) for l in range(len(theirs)) for h in range(heads)  # a row with both, scored
                       if (theirs[l, h] & own[l, h].isfinite()).any() and (~theirs[l, h]).any())
    row, kept_row = own[layer, head], theirs[layer, head]
    best = torch.where(kept_row & row.isfinite(), row, -float("inf")).argmax()
    worst = torch.where(~kept_row, row, float("inf")).argmin()
    assert row[best] > row[worst] and not mismatches(kept, case, n, own, one_cut=name == "kvzip")
    theirs[layer, head, best], theirs[layer, head, worst] = False, True
    packed = [base64.b64encode(np.packbits(layer.flatten().numpy(), bitorder="little").tobytes()).decode()
              for layer in theirs]
    assert mismatches(kept, {**case, "kept": packed}, n, own, one_cut=name == "kvzip")


def test_the_goldens_hold_what_they_test(oracle):
    """PyramidKV's goldens hold a pyramid and kvpress's uniform fallback; AdaKV's and KVzip's, heads of different
    lengths; Knorm's, the few rows cut on a tie."""
    _, goldens, config, prompts, _ = oracle
    heads = config.num_key_value_heads

    def sizes(case):  # kept per (layer, head)
        n = len(prompts[case["prompt"]])
        return [[len(h) for h in golden_kept(layer, heads, n)] for layer in case["kept"]]

    layer_sizes = [{row[0] for row in sizes(case)} for case in goldens["pyramidkv"]["cases"]]
    assert any(len(s) > 1 for s in layer_sizes) and any(len(s) == 1 for s in layer_sizes)
    for name in ("adakv", "kvzip"):
        assert all(len({k for row in sizes(case) for k in row}) > 1 for case in goldens[name]["cases"])
    assert 0 < sum(len(case["tied"]) for case in goldens["knorm"]["cases"]) < 10


@pytest.mark.parametrize("name", list(DEFAULT_READINGS))
def test_the_default_reading_is_not_kvpress(oracle, name):
    """Each switch matters: without it kvbench keeps other entries than kvpress on a golden case of prompt 0."""
    runs, goldens, _, prompts, _ = oracle
    cases = [case for case in goldens[name]["cases"] if case["prompt"] == 0]
    assert any(mismatches(runs[f"default {name}", 0, case["ratio"]], case, len(prompts[0])) for case in cases)


def test_tova_keep_last_keeps_the_last_prompt_entry():
    """kvpress's TOVA keeps the last prompt token whatever it scores (on the golden prompts it is in the top anyway,
    so the goldens cannot tell the readings apart): here it scores lowest."""
    scores = torch.tensor([[[0.4, 0.3, 0.2, 0.1]]]).expand(1, 3, 4)
    for keep_last, expected in [(False, [0, 1]), (True, [0, 3])]:
        method = METHODS["tova"](keep_last=keep_last)
        state = method.start(4, 2, 1, 0)
        assert method.evict(state, 0, scores, prefill=True)[0, 0].tolist() == expected
        assert method.evict(state, 0, scores, prefill=False)[0, 0].tolist() == [0, 1]  # decode steps: TOVA's rule


@pytest.mark.parametrize("method, kwargs, message", [
    ("pyramidkv", dict(schedule="kvpres"), "schedule='kvpres' is not one of pyramidkv, adakv, kvpress"),
    ("pyramidkv", dict(schedule="kvpress", exact=True), "exact=true is a schedule of its own"),
    ("h2o", dict(normalize="mean"), "normalize='mean' is not one of none, observed"),
    ("h2o", dict(normalize="observed"), "normalize=observed needs variant=prefill_only"),
    ("kvzip", dict(sinks="kept"), "sinks='kept' is not one of apart, repeated"),
])
def test_bad_kvpress_switches_fail_in_one_line(method, kwargs, message):
    with pytest.raises(ValueError, match=message) as error:
        METHODS[method](**kwargs)
    assert "\n" not in str(error.value)
