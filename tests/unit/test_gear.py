"""GEAR (kvbench/methods/gear.py, kvbench/cache/gear.py): what a layer reads back equals the reference's compression
(goldens made by scripts/make_gear_goldens.py, running opengear-project/GEAR's `gearslkivi_channelQ_new` and
`gearslkivi_tokenQ_new`), the bytes held are the stored parts' (hand-counted), and a generation runs on it."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

import kvbench.methods  # noqa: F401
from kvbench.cache.gear import GearLayer, compress, outlier_count
from kvbench.cache.kv_cache import KVLayer
from kvbench.engine.batching import generate
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from tests.unit.tiny import prompt, tiny_model

ROOT = Path(__file__).resolve().parents[2]
CASES = json.loads((ROOT / "tests/fixtures/gear/goldens.json").read_text())["cases"]


def states(case: dict):
    spec = importlib.util.spec_from_file_location("gear_goldens", ROOT / "scripts/make_gear_goldens.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script.states(case["seed"], case["heads"], case["tokens"], case["head_dim"])


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"seed{c['seed']}")
def test_read_back_equals_the_reference_compression(case):
    """Keys (per-channel backbone, a full-precision tail past the last whole group) and values (per-token groups
    across heads), outliers, fp16 rounding and the low-rank part from the same random start."""
    keys, values = states(case)
    settings = (case["bits"], case["group"], case["sparsity"], case["rank"], case["loop"])
    got_k = compress(keys, "channel", *settings, torch.Generator().manual_seed(case["seed"])).read()
    got_v = compress(values, "token", *settings, torch.Generator().manual_seed(case["seed"] + 1)).read()
    torch.testing.assert_close(got_k[0], torch.tensor(case["keys"]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_v[0], torch.tensor(case["values"]), rtol=1e-4, atol=1e-4)


def test_outliers_come_back_exactly_and_the_rank_lowers_the_error():
    keys, _ = states(CASES[0])
    gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    without = compress(keys, "channel", 2, 16, 0.25, 0, 1, gen())
    rows = keys.transpose(-1, -2)
    assert torch.equal(without.outlier_val, rows.gather(-1, without.outlier_idx.long()))  # stored exactly
    # the reference's count per row: int(int(numel x sparsity) / B / T / 2) = int(2 x 16 x 0.25 / 2) = 4 each side
    assert without.outlier_idx.shape[-1] == 2 * outlier_count(tuple(keys.shape), 0.25) == 2 * 4
    back = without.read().transpose(-1, -2).gather(-1, without.outlier_idx.long())
    assert torch.equal(back, without.outlier_val.half().float())  # read back exactly (after the fp16 rounding)
    errors = [(compress(keys, "channel", 2, 16, 0.25, rank, 3, gen()).read() - keys).norm() for rank in (0, 2, 6)]
    assert errors[0] > errors[1] > errors[2]  # each rank removes more of what quantization left


def test_a_layer_holds_the_stored_parts_bytes():
    """2 heads, 64 tokens, D = 16, fp32, 2 bits, group 16, sparsity 0.25, rank 2. Keys: codes 2x16x64 / 4 bytes,
    fp32 scale + zero per (head, channel, 4 groups), 2 x 4 outliers per channel row (fp32 value + int32 offset),
    Q 2x64x2 and P 2x16x2 fp32. Values: codes the same, scale + zero per (token, 2 groups of 16 across the 32
    channels), 2 x 4 outliers per token row, Q and P the same."""
    g = torch.Generator().manual_seed(0)
    layer = KVLayer()
    layer.update(torch.randn(1, 2, 64, 16, generator=g), torch.randn(1, 2, 64, 16, generator=g))
    gear = GearLayer.from_layer(layer, 2, 16, 0.25, 2, 3, torch.Generator().manual_seed(0))
    k = outlier_count((1, 2, 64, 16), 0.25)  # int(int(512) / 64 / 2)
    assert k == 4
    codes = 2 * 64 * 16 // 4
    keys = codes + 2 * (2 * 16 * 4) * 4 + 2 * 16 * 2 * k * 8 + (2 * 64 * 2 + 2 * 16 * 2) * 4
    values = codes + 2 * (64 * 2) * 4 + 64 * 2 * k * 8 + (2 * 64 * 2 + 2 * 16 * 2) * 4
    assert gear.nbytes() == keys + values
    assert gear.nbytes() < layer.nbytes()  # 11776 of 16384 bytes here: a quarter of the entries are outliers
    gear.update(torch.ones(1, 2, 1, 16), torch.ones(1, 2, 1, 16))  # a generated token stays full precision
    assert gear.nbytes() == keys + values + 2 * 2 * 16 * 4 and gear.get_seq_length() == 65


def test_a_generation_attends_the_read_back_and_refuses_a_group_across_heads_in_one_line():
    model, ids = tiny_model("llama", layers=2), prompt(80)
    method = METHODS["gear"](group_size=16)
    assert method.prepare(model, None) is None
    seen = []
    with AttentionCapture(model) as capture:
        def on_logits(t, logits):
            seen.append([type(layer).__name__ for layer in capture.cache.layers])
        gen = generate(model, None, method, capture, ids, None, 4, on_logits=on_logits, eos_ids=set())
    assert len(gen.token_ids) == 4 and seen[-1] == ["GearLayer", "GearLayer"]
    assert gen.kv_bytes < gen.full_kv_bytes / 2
    with pytest.raises(ValueError, match="gear: group_size=24 must divide"):
        METHODS["gear"](group_size=24).prepare(model, None)
