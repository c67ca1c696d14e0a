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


@pytest.mark.parametrize("case", GOLDENS["cases"], ids=lambda c: f"prompt{c['prompt_len']}")
def test_first_decode_compression_equals_the_reference(model, case):
    n, step = case["prompt_len"], case["step"]
    method = METHODS["rkv"](window=GOLDENS["window"], divide_length=GOLDENS["divide_length"])
    kept = {}
    with AttentionCapture(model, window=method.query_window) as capture:
        def after(t, logits):  # right after decode step `step` (its forward fed the sequence's token n + step)
            if capture.cache.layers[0].seen_tokens == n + step:
                kept.update({i: layer.positions[0].tolist() for i, layer in enumerate(capture.cache.layers)})

        gen = generate(model, None, method, capture, SCRIPT.prompt(n), GOLDENS["budget"], step + 1,
                       on_logits=after, eos_ids=set())
    assert SCRIPT.first_step(n) == step
    assert gen.token_ids[:step] == case["tokens"]
    assert [sorted(map(sorted, kept[i])) for i in range(len(kept))] == [sorted(map(sorted, k)) for k in case["kept"]]
