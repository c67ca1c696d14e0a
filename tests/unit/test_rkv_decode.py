"""R-KV's first compression while decoding equals the reference code's (Zefan-Cai/R-KV, run by
scripts/make_rkv_decode_goldens.py) from prompts just below, at and above a multiple of `divide_length` (128): the
step it runs at, the entries it keeps (its window's queries start in the prompt when fewer than `window` tokens were
generated) and the tokens decoded up to it."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, LlamaConfig

import kvbench.methods  # noqa: F401
from kvbench.engine.batching import generate
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
