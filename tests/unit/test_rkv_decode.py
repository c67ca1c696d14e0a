"""R-KV's compressions while decoding equal the reference code's (Zefan-Cai/R-KV, run by
scripts/make_rkv_decode_goldens.py on a tiny Llama), from prompts just below, at and above a multiple of
`divide_length` (128) and through three compressions: the steps they run at, the entries they keep (the window's
queries start in the prompt while fewer than `window` tokens were generated; the entries are scored in the
reference's cache order, the last kept ones best first) and the tokens decoded; batched decoding keeps them."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import kvbench.methods  # noqa: F401
from kvbench.engine.batching import Request, generate, generate_batched
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS

ROOT = Path(__file__).resolve().parents[2]
GOLDENS = json.loads((ROOT / "tests/fixtures/rkv/decode_goldens.json").read_text())


def golden_script():
    spec = importlib.util.spec_from_file_location("make_rkv_decode_goldens",
                                                  ROOT / "scripts/make_rkv_decode_goldens.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


SCRIPT = golden_script()


@pytest.fixture(scope="module")
def model():
    """The golden script's tiny Llama, with its version-independent seeded weights."""
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SCRIPT.CONFIG), attn_implementation="sdpa").eval()
    SCRIPT.init_weights(model)
    return model


@pytest.mark.parametrize("case", GOLDENS["cases"], ids=lambda c: f"prompt{c['prompt_len']}-every{c['divide_length']}")
def test_compressions_while_decoding_equal_the_reference(model, case):
    n, steps = case["prompt_len"], case["steps"]
    method = METHODS["rkv"](window=GOLDENS["window"], divide_length=case["divide_length"])
    kept = []
    with AttentionCapture(model, window=method.query_window) as capture:
        def after(t, logits):  # after the prefill, then after each decode step (its forward fed token n + t - 1)
            if capture.cache.layers[0].seen_tokens - n in steps:
                kept.append([sorted(map(sorted, layer.positions[0].tolist())) for layer in capture.cache.layers])

        gen = generate(model, None, method, capture, SCRIPT.prompt(n), GOLDENS["budget"], len(case["tokens"]) + 1,
                       on_logits=after, eos_ids=set())
    assert gen.token_ids[:len(case["tokens"])] == case["tokens"]
    expected = [[sorted(map(sorted, layer[c])) for layer in case["kept"]] for c in range(len(steps))]
    assert kept == expected


def test_batched_decoding_compresses_as_each_alone(model):
    """Prompts 127 and 128 decoded together (a compressed layer in batched rows, the ranking and the prompt's
    queries per sample) give every step's logits of each alone, past their compressions at steps 2 and 1."""
    method = METHODS["rkv"](window=GOLDENS["window"])
    logits = {"alone": {}, "batched": {}}

    def request(n: int, run: str) -> Request:
        return Request(SCRIPT.prompt(n), GOLDENS["budget"], 6, tag=n,
                       on_logits=lambda t, step: logits[run].setdefault((n, t), step.clone()))

    with AttentionCapture(model, window=method.query_window) as capture:
        for n in (127, 128):
            generate(model, None, method, capture, SCRIPT.prompt(n), GOLDENS["budget"], 6, eos_ids=set(),
                     on_logits=lambda t, step, n=n: logits["alone"].setdefault((n, t), step.clone()))
        list(generate_batched(model, None, method, capture, [request(n, "batched") for n in (127, 128)], 2,
                              eos_ids=set()))
    assert logits["batched"].keys() == logits["alone"].keys() and len(logits["alone"]) == 12
    for key, alone in logits["alone"].items():
        torch.testing.assert_close(logits["batched"][key], alone, rtol=1e-5, atol=1e-5)
