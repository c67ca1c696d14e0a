"""R-KV (kvbench/methods/rkv.py): its selections equal the reference code's on golden cases (made by
scripts/make_rkv_goldens.py from Zefan-Cai/R-KV), and it compresses while decoding by itself, on R-KV's schedule."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

import kvbench.methods  # noqa: F401
from kvbench.engine.batching import generate
from kvbench.methods.base import LayerView
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from tests.unit.tiny import prompt, tiny_model

ROOT = Path(__file__).resolve().parents[2]
GOLDENS = json.loads((ROOT / "tests/fixtures/rkv/goldens.json").read_text())["cases"]


def golden_inputs(case: dict):
    """The seeded keys and queries the goldens were made from (the script's own `inputs`)."""
    spec = importlib.util.spec_from_file_location("make_rkv_goldens", ROOT / "scripts/make_rkv_goldens.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script.inputs(case["seed"], case["n"], case["query_heads"], case["kv_heads"], case["head_dim"],
                         case["clustered"])


@pytest.mark.parametrize("case", GOLDENS, ids=lambda c: f"seed{c['seed']}")
def test_selections_equal_the_reference_code(case):
    keys, queries = golden_inputs(case)
    method = METHODS["rkv"](window=case["window"], mix_lambda=case["mix_lambda"])
    view = LayerView(0, 1, keys, keys.flip(-1), queries, 1 / math.sqrt(case["head_dim"]))
    if case["n"] > case["budget"]:
        kept = method.select(view, case["budget"])[0].tolist()
    else:
        kept = [list(range(case["n"]))] * case["kv_heads"]
    assert kept == case["kept"]


def test_it_compresses_while_decoding_every_divide_length_sequence_tokens():
    """Budget 40, divide_length 16: after a step whose sequence length was a multiple of 16, the next step's token
    goes in and the layer comes back to 40 entries; it never holds more than 40 + 16."""
    model, lengths = tiny_model("llama"), []
    method = METHODS["rkv"](divide_length=16)
    with AttentionCapture(model, window=method.query_window) as capture:
        def seen(t, logits):
            layer = capture.cache.layers[0]
            lengths.append((layer.seen_tokens, layer.keys.shape[-2]))

        gen = generate(model, None, method, capture, prompt(70), 40, 60, on_logits=seen, eos_ids=set())
    assert len(gen.token_ids) == 60
    for seen_tokens, held in lengths:  # the last compression: the prefill's (at 70) or a step's at seen ≡ 1 mod 16
        last = max([70] + [s for s in range(71, seen_tokens + 1) if (s - 1) % 16 == 0])
        assert held == 40 + seen_tokens - last, (seen_tokens, held)
    assert max(held for _, held in lengths) == 40 + 15
    assert [s for s, held in lengths if held == 40] == [70, 81, 97, 113, 129]  # the prefill, then every 16
