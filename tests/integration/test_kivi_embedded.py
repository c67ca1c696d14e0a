"""KIVI on the embedded SmolLM2 (slow: ~1 min on 2 CPU cores): TailorKV Table 1's "1-bit (KIVI)" row through
`method=kivi` equals `method=tailorkv method.rest=quantized` logit for logit and byte for byte, and SnapKV at budget
128 stored at 2 bits (`+method.quantize=kivi2`) holds the bytes worked out by hand: 1/8 of the 16-bit bytes for the
codes, plus scales, zeros and the full-precision residual."""
from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

import kvbench.methods  # noqa: F401
from kvbench.engine.batching import generate
from kvbench.methods.wrappers import Switches, wrap
from kvbench.models import AttentionCapture, ModelSpec, load
from kvbench.registry import METHODS
from kvbench.runs.config import CONFIG_DIR

pytestmark = pytest.mark.slow
LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64


@pytest.fixture(scope="module")
def smollm2():
    return load(ModelSpec(name="smollm2", path="embedded"))


@pytest.fixture(scope="module")
def needle_ids(smollm2):
    """A 1k NIAH prompt exactly as `python -m kvbench.run dataset=niah` builds it."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["dataset.context_lengths=[1000]", "dataset.depth_percents=[50]"])
    (sample,) = instantiate(cfg.dataset).build(smollm2[1], 8000)
    return torch.tensor([smollm2[1](sample.prompt).input_ids])


def run(smollm2, method, ids, budget, new_tokens):
    model, tok = smollm2
    logits = []
    with AttentionCapture(model, window=method.query_window) as capture:
        gen = generate(model, tok, method, capture, ids, budget, new_tokens, eos_ids=set(),
                       on_logits=lambda t, x: logits.append(x.clone()))
    return gen, logits


def test_kivi_one_bit_is_tailorkvs_every_layer_quantized_row(smollm2, needle_ids):
    kivi = METHODS["kivi"](bits=1, group_size=64, residual=128, arithmetic="tailorkv")
    tailorkv = METHODS["tailorkv"](bits=1, group_size=64, residual=128, rest="quantized", quant_layers=[0])
    a, logits_a = run(smollm2, kivi, needle_ids, 192, 12)  # 12 steps: no key block fills; values slide
    b, logits_b = run(smollm2, tailorkv, needle_ids, 192, 12)
    assert a.token_ids == b.token_ids
    assert all(torch.equal(x, y) for x, y in zip(logits_a, logits_b)) and len(logits_a) == 12
    assert (a.kv_bytes, a.kv_bytes_final, a.kept_per_head) == (b.kv_bytes, b.kv_bytes_final, b.kept_per_head)
    assert a.kv_bytes < a.full_kv_bytes / 4


def test_snapkv_128_at_two_bits_holds_the_bytes_worked_out_by_hand(smollm2, needle_ids):
    snapkv, _ = run(smollm2, METHODS["snapkv"](), needle_ids, 128, 1)
    packed, _ = run(smollm2, wrap(METHODS["snapkv"](), Switches(quantize="kivi2", quantize_residual=32)),
                    needle_ids, 128, 1)
    heads = LAYERS * KV_HEADS
    sixteen_bit = 128 * HEAD_DIM * 2 * 2 * heads  # SnapKV 128 at 16 bits: keys + values, 2 bytes each
    assert snapkv.kv_bytes == 2 * sixteen_bit  # the embedded model runs in fp32
    # per KV head and layer, 128 kept entries, residual 32, group 32: every key quantized (128 = 4 groups of
    # tokens per channel), the oldest 96 values quantized (2 groups of 32 channels each), the newest 32 in fp32;
    # KIVI keeps scale and zero in the cache's dtype (fp32 here: 4 bytes)
    codes = (128 * HEAD_DIM + 96 * HEAD_DIM) * 2 // 8  # 2 bits: 1/8 of those entries' 16-bit bytes
    scales = (HEAD_DIM * 128 // 32 + 96 * HEAD_DIM // 32) * 2 * 4
    residual = 32 * HEAD_DIM * 4
    assert packed.kv_bytes == (codes + scales + residual) * heads
    assert packed.kept_per_head == snapkv.kept_per_head  # the same entries, fewer bytes
