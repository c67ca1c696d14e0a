"""Fast KVzip: the gate's scores against a direct loop over heads, tokens, queries and sink keys; the kept entries
against a recomputation from the layers' inputs; kvpress 0.5.5's FastKVzipPress masked sets on the embedded model
with the same seeded random gate (tests/fixtures/kvpress_fastkvzip, made by scripts/make_kvpress_goldens_fastkvzip.py;
compared with kvbench's own scores on what float rounding cannot flip, tests/unit/decidable.py: ties, e.g. repeated
tokens in layer 0, whose gate sees the token alone, by count); the static step; the one-line refusals."""
from __future__ import annotations

import importlib.util
import json
import math
from functools import partial
from pathlib import Path

import pytest
import torch

import kvbench.methods  # noqa: F401
from kvbench.cache.kv_cache import KVCache
from kvbench.engine.batching import generate_batched
from kvbench.engine.generation import compress, prefill, prepare, reconstruct
from kvbench.engine.static import StaticDecoder, unsupported
from kvbench.methods.fastkvzip import gate_file, gate_scores, random_gates
from kvbench.models import AttentionCapture, ModelSpec, load
from kvbench.registry import METHODS
from tests.unit.decidable import mask, topk_disagreements
from tests.unit.test_compiled_step import FIELDS, requests
from tests.unit.test_kvpress_oracle import kept_positions
from tests.unit.tiny import prompt, tiny_model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GOLDEN = json.loads((FIXTURES / "kvpress_fastkvzip" / "goldens.json").read_text())
PROMPTS = json.loads((FIXTURES / "kvpress" / "prompts.json").read_text())["ids"]


def loop_scores(gate: dict, hidden: torch.Tensor) -> torch.Tensor:
    """The gate written out entry by entry: `[H_kv, n]` from `hidden` `[n, hidden]`."""
    n_heads, _, n_sinks, d = gate["k_base"].shape
    groups = gate["b"].shape[-1]

    def normed(v, weight):
        return [x / math.sqrt(sum(y * y for y in v.tolist()) / d + 1e-6) * w for x, w in zip(v.tolist(), weight)]

    out = torch.zeros(n_heads, hidden.shape[0])
    for h in range(n_heads):
        k_rows = gate["k_proj.weight"][h * d:(h + 1) * d]
        for t in range(hidden.shape[0]):
            k = normed(k_rows @ hidden[t], gate["k_norm.weight"].tolist())
            total = 0.0
            for g in range(groups):
                rows = slice((h * groups + g) * d, (h * groups + g + 1) * d)
                q = normed(gate["q_proj.weight"][rows] @ hidden[t] + gate["q_proj.bias"][rows],
                           gate["q_norm.weight"].tolist())
                logit = sum(a * b for a, b in zip(k, q)) / math.sqrt(d) + float(gate["b"][h, 0, g])
                sinks = [sum(a * b for a, b in zip(gate["k_base"][h, 0, j].tolist(), q)) / math.sqrt(d)
                         for j in range(n_sinks)]
                total += 1 / (1 + sum(math.exp(s - logit) for s in sinks))
            out[h, t] = total / groups
    return out


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", layers=3)


def test_the_gate_equals_a_direct_loop(tiny):
    gate = random_gates(tiny.config, seed=3)[1]
    hidden = torch.randn(1, 12, tiny.config.hidden_size, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(gate_scores(gate, hidden)[0], loop_scores(gate, hidden[0]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layerwise", [False, True])
def test_the_kept_entries_are_the_top_gate_scores_with_sinks_and_window(tiny, layerwise):
    """Recomputed from each layer's attention input (the input norm's output): sinks 4 and the last
    max(1, int(0.02 n)) = 3 entries kept, then the top budget x layers x heads (layerwise: x heads per layer)."""
    n, budget = 150, 24
    method = METHODS["fastkvzip"](gates="random", layerwise=layerwise)
    method.load(tiny.config, "")
    gates, inputs = random_gates(tiny.config), {}
    hooks = [layer.input_layernorm.register_forward_hook(lambda m, a, out, i=i: inputs.__setitem__(i, out))
             for i, layer in enumerate(tiny.model.layers)]
    with AttentionCapture(tiny) as capture:
        kept = kept_positions(prepare(tiny, method, capture, prompt(n), budget, 1).cache)
    for hook in hooks:
        hook.remove()
    scores = torch.stack([gate_scores(gates[i], inputs[i])[0] for i in range(3)])  # [L, H, n]
    scores[..., :4] = scores[..., -3:] = 2.0
    order = scores.flatten(1).argsort(dim=1, descending=True)[:, :budget * 2] if layerwise else \
        scores.flatten().argsort(descending=True)[:budget * 3 * 2]
    expected = torch.zeros(scores.numel(), dtype=torch.bool)
    expected[(order + torch.arange(3)[:, None] * 2 * n).flatten() if layerwise else order] = True
    expected = expected.view(3, 2, n)
    assert kept == [[set(head.nonzero().flatten().tolist()) for head in layer] for layer in expected]
    assert len({len(head) for layer in kept for head in layer}) > 1  # heads really keep different lengths


@pytest.fixture(scope="module")
def golden_kept():
    """kvbench's kept positions per golden case: one prefill per prompt scores the inputs with the random gate,
    each case selects from a copy of its cache."""
    model, _ = load(ModelSpec(name="smollm2", path="embedded"))
    methods = {lw: METHODS["fastkvzip"](gates="random", layerwise=lw) for lw in (False, True)}
    for method in methods.values():
        method.load(model.config, "")
    runs = {}
    with AttentionCapture(model) as capture:
        for p, ids in enumerate(PROMPTS):
            capture.reset()
            capture.input_scorer = partial(methods[False].input_scores, config=model.config)
            cache, ids = KVCache(), torch.tensor([ids])
            prefill(model, ids, cache)
            scores = dict(capture.input_scores)
            for case in (c for c in GOLDEN["cases"] if c["prompt"] == p):
                compressed, budget = cache.clone(), round(ids.shape[1] * (1 - case["ratio"]))
                capture.input_scores = dict(scores)
                reconstruct(model, methods[case["layerwise"]], capture, compressed, ids, budget)
                own = torch.stack([capture.key_scores[i][0] for i in sorted(capture.key_scores)]).double()
                compress(methods[case["layerwise"]], compressed, capture, budget)
                runs[p, case["ratio"], case["layerwise"]] = kept_positions(compressed), own
    return runs


def kept_masks(kept: list, n: int) -> torch.Tensor:
    return torch.stack([torch.stack([mask(h, n) for h in heads]) for heads in kept])


def disagreements(case: dict, ours: list, scores: torch.Tensor, golden_layers: list) -> list[str]:
    """On what float rounding cannot flip (tests/unit/decidable.py), with kvbench's own gate scores (sinks and
    window at 1): one top-k over every layer and head, or per layer (`layerwise`)."""
    n = scores.shape[-1]
    theirs = torch.tensor([[[bool(int(m, 16) >> i & 1) for i in range(n)] for m in heads] for heads in golden_layers])
    ours = kept_masks(ours, n)
    if not case["layerwise"]:
        return topk_disagreements(scores, ours, theirs, f"ratio {case['ratio']}")
    return [p for layer in range(len(scores))
            for p in topk_disagreements(scores[layer], ours[layer], theirs[layer], f"layer {layer}")]


def test_kvbench_keeps_what_kvpress_keeps(golden_kept):
    assert len(GOLDEN["cases"]) == 6
    for case in GOLDEN["cases"]:
        ours, scores = golden_kept[case["prompt"], case["ratio"], case["layerwise"]]
        assert not disagreements(case, ours, scores, case["kept"])


def test_a_real_difference_from_kvpress_still_fails(golden_kept):
    """A clearly kept entry swapped for a clearly evicted one in kvpress's golden (same count) is reported."""
    case = GOLDEN["cases"][0]
    ours, scores = golden_kept[case["prompt"], case["ratio"], case["layerwise"]]
    layers = [list(heads) for heads in case["kept"]]
    n = scores.shape[-1]
    layer, head = next((l, h) for l in range(len(layers)) for h in range(len(layers[l]))  # a row with both
                       if 0 < bin(int(layers[l][h], 16)).count("1") < n)
    row, held = scores[layer, head], int(layers[layer][head], 16)
    inside = [j for j in range(n) if held >> j & 1 and row[j] < 1]  # (score 1: sinks, window)
    outside = [j for j in range(n) if not held >> j & 1]
    best, worst = max(inside, key=lambda j: row[j]), min(outside, key=lambda j: row[j])
    layers[layer][head] = hex(held - (1 << best) + (1 << worst))
    assert disagreements(case, ours, scores, layers)


def test_the_static_step_decodes_as_the_eager_engine():
    """Its per-head layers in the static step's rows (uncompiled: the captured step is kvzip's, the same layers,
    in tests/unit/test_compiled_step.py), equal to the eager engine at batch 1."""
    model, method = tiny_model("llama", layers=2), METHODS["fastkvzip"](gates="random")
    method.load(model.config, "")
    assert unsupported(method) is None
    with AttentionCapture(model) as capture:
        eager = {r.tag: g for r, g in generate_batched(model, None, method, capture, requests(48), 1)}
        static = {r.tag: g for r, g in StaticDecoder(model, None, method, capture, 2, eos_ids=set()).run(requests(48))}
    for i, one in eager.items():
        assert static[i].step == "static" and one.step == "eager"
        for field in FIELDS:
            assert getattr(static[i], field) == getattr(one, field), (i, field)


def test_bad_settings_and_missing_gates_fail_in_one_line(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    for fields, match in [({"gates": "nowhere.safetensors"}, "not a file"), ({"window_ratio": 1.0}, "window_ratio"),
                          ({"n_sink": -1}, "n_sink")]:
        with pytest.raises(ValueError, match=match):
            METHODS["fastkvzip"](**fields)
    with pytest.raises(ValueError, match="train_fastkvzip_embedded.py") as error:
        METHODS["fastkvzip"]().load(tiny.config, "SmolLM2-135M-Instruct")
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=r"convert_fastkvzip_gates.py --model Qwen/Qwen3-8B --revision"):
        METHODS["fastkvzip"]().load(tiny.config, "Qwen/Qwen3-8B")
    with pytest.raises(ValueError, match="n_sink=4 must be < budget=4"):
        METHODS["fastkvzip"]().check_budget(4)


def test_a_published_gate_file_converts_to_what_gates_auto_reads(tiny, tmp_path, monkeypatch):
    """scripts/convert_fastkvzip_gates.py on a .pt shaped as the authors' (bf16 state dicts under "module"): the
    file lands where `gates=auto` looks, its revision goes into the manifest, its scores are the gate's."""
    script = Path(__file__).parents[2] / "scripts/convert_fastkvzip_gates.py"
    spec = importlib.util.spec_from_file_location("convert", script)
    convert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert)
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    gates = [{name: t.bfloat16() for name, t in layer.items()} for layer in random_gates(tiny.config, seed=5)]
    torch.save({"module": gates, "loss": [0.1]}, tmp_path / "q3_dim16_sink16.pt")
    out = gate_file("org/Tiny-Model", 3)
    convert.convert(convert.read_published(tmp_path / "q3_dim16_sink16.pt"), out, {"revision": "abc123"})
    method = METHODS["fastkvzip"]()
    manifest = method.load(tiny.config, "org/Tiny-Model")
    assert manifest["revision"] == "abc123" and manifest["file"] == str(out)
    hidden = torch.randn(1, 5, tiny.config.hidden_size)
    torch.testing.assert_close(method.input_scores(0, hidden, tiny.config),
                               method.protect(gate_scores({k: v.float() for k, v in gates[0].items()}, hidden)))
