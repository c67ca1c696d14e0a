"""The shared quantizer and the quantized layer against goldens made by running the KIVI authors' code
(scripts/make_kivi_goldens.py, jy-yuan/KIVI @876b4d2): codes, scales, zeros and packed bytes of keys (per channel,
groups of tokens) and values (per token, groups of channels) in fp16 and fp32, and what each decode step attends
across the residual window's boundaries (prompt lengths below, at and above a multiple of the residual, a key block
filling, the value window sliding). Also: the quantizer's `dim` and `cat` along and across the quantized axis."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvbench.cache.kv_cache import KVLayer
from kvbench.cache.quantized import QuantizedLayer
from kvbench.cache.quantizer import cat, quantize, unpack

GOLDENS = Path(__file__).parents[1] / "fixtures" / "kivi" / "goldens.safetensors"
QUANT_CASES = {"fp16_b2_g32": (2, 32), "fp16_b4_g32": (4, 32), "fp16_b8_g32": (8, 32), "fp32_b2_g32": (2, 32),
               "fp32_b4_g16": (4, 16)}
CACHE_CASES = {"cache_b2_n100": (2, 32, 32, 100, 40, (1, 28, 29, 40)), "cache_b4_n64": (4, 32, 64, 64, 3, (1, 3)),
               "cache_b2_n20": (2, 32, 32, 20, 14, (1, 12, 13, 14))}


@pytest.fixture(scope="module")
def gold() -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    return load_file(str(GOLDENS))


@pytest.mark.parametrize("case", QUANT_CASES)
def test_values_per_token_equal_the_reference(gold, case):
    bits, group = QUANT_CASES[case]
    values = gold[f"{case}.values"]
    q = quantize(values, bits, group, arithmetic="kivi")
    assert q.scale.dtype == q.zero.dtype == values.dtype  # the reference stores them in the cache's dtype
    assert torch.equal(q.packed, gold[f"{case}.v_bytes"])  # the same bytes as its int32 words
    assert torch.equal(q.scale, gold[f"{case}.v_scale"]) and torch.equal(q.zero, gold[f"{case}.v_zero"])
    assert torch.equal(q.dequantize(values.dtype), gold[f"{case}.v_dequant"])


@pytest.mark.parametrize("case", QUANT_CASES)
def test_keys_per_channel_equal_the_reference(gold, case):
    bits, group = QUANT_CASES[case]
    keys = gold[f"{case}.keys"]  # [B, H, T, D]: groups of `group` tokens along T, per channel
    q = quantize(keys, bits, group, dim=-2, arithmetic="kivi")
    assert q.packed.shape == (1, 2, keys.shape[-1], keys.shape[-2] * bits // 8)  # stored [B, H, D, T packed]
    assert torch.equal(q.packed, gold[f"{case}.k_bytes"])
    assert torch.equal(q.scale, gold[f"{case}.k_scale"]) and torch.equal(q.zero, gold[f"{case}.k_zero"])
    xhat = q.dequantize(keys.dtype)
    assert xhat.shape == keys.shape
    assert torch.equal(xhat, gold[f"{case}.k_dequant"])
    assert torch.equal(xhat, gold[f"{case}.k_dequant_kcache"])  # the reference's other key layout agrees


def test_tailorkv_arithmetic_differs_from_kivi_only_in_rounding(gold):
    # TailorKV's rule (fp32 math, fp16 scale/zero) on fp32 keys: codes may differ from KIVI's fp32 rule only where
    # fp16-rounding the scale moves a value across a rounding boundary, so the dequantized keys stay within one step
    keys = gold["fp32_b2_g32.keys"]
    ours = quantize(keys, 2, 32, dim=-2).dequantize()
    ref = gold["fp32_b2_g32.k_dequant"]
    step = quantize(keys, 2, 32, dim=-2, arithmetic="kivi").scale.float()  # [B, H, D, T / 32]
    bound = step.repeat_interleave(32, dim=-1).transpose(-1, -2) * 1.01
    assert ((ours - ref).abs() <= bound).all()
    codes = unpack(quantize(keys, 2, 32, dim=-2).packed, 2, 64)
    assert (codes == unpack(gold["fp32_b2_g32.k_bytes"], 2, 64)).float().mean() > 0.95  # the same codes, mostly


def kivi_layer(keys: torch.Tensor, values: torch.Tensor, bits: int, group: int, residual: int) -> QuantizedLayer:
    layer = KVLayer()
    layer.update(keys, values)
    return QuantizedLayer.from_layer(layer, bits, group, residual, arithmetic="kivi")


@pytest.mark.parametrize("case", CACHE_CASES)
def test_decode_steps_attend_what_the_reference_attends(gold, case):
    bits, group, residual, n, steps, recorded = CACHE_CASES[case]
    keys, values = gold[f"{case}.keys"], gold[f"{case}.values"]
    layer = kivi_layer(keys[:, :, :n], values[:, :, :n], bits, group, residual)
    for t in range(1, steps + 1):
        layer.update(keys[:, :, n + t - 1:n + t], values[:, :, n + t - 1:n + t])
        if t in recorded:
            kv = layer.decode_kv()
            assert torch.equal(kv.keys.to(keys.dtype), gold[f"{case}.step{t}.keys"]), f"step {t} keys"
            assert torch.equal(kv.values.to(values.dtype), gold[f"{case}.step{t}.values"]), f"step {t} values"
    assert layer.get_seq_length() == n + steps


def test_bytes_of_a_kivi_layer_by_hand(gold):
    # 100 fp16 prompt tokens, R = 32, group 32, 2 bits, H = 2, D = 32: keys 96 quantized + 4 full, values 68 + 32
    keys, values = gold["cache_b2_n100.keys"][:, :, :100], gold["cache_b2_n100.values"][:, :, :100]
    layer = kivi_layer(keys, values, 2, 32, 32)
    key_codes = 2 * 32 * 96 * 2 // 8  # heads x channels x tokens x bits / 8
    key_stats = 2 * 32 * (96 // 32) * 2 * 2  # one fp16 scale and zero per channel per group of 32 tokens
    value_codes, value_stats = 2 * 68 * 32 * 2 // 8, 2 * 68 * (32 // 32) * 2 * 2
    full = (4 + 32) * 2 * 32 * 2  # fp16 residual keys and values
    assert layer.nbytes() == key_codes + key_stats + value_codes + value_stats + full


# --- the quantizer's axis and concatenation ---------------------------------------------------------------------
def test_dim_equals_quantizing_the_moved_axis():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, 16)
    along_tokens = quantize(x, 2, 32, dim=2)
    moved = quantize(x.transpose(-1, -2), 2, 32)
    assert torch.equal(along_tokens.packed, moved.packed) and torch.equal(along_tokens.scale, moved.scale)
    assert torch.equal(along_tokens.dequantize(), moved.dequantize().transpose(-1, -2))
    assert unpack(along_tokens.packed, 2, 64).shape == (2, 3, 16, 64)


def test_cat_along_and_across_the_quantized_axis():
    torch.manual_seed(1)
    x = torch.randn(1, 2, 96, 16)
    whole = quantize(x, 4, 32, dim=-2)
    joined = cat(quantize(x[:, :, :64], 4, 32, dim=-2), quantize(x[:, :, 64:], 4, 32, dim=-2), dim=-2)
    assert torch.equal(joined.dequantize(), whole.dequantize()) and joined.length == 96
    heads = cat(quantize(x[:, :1], 4, 32, dim=-2), quantize(x[:, 1:], 4, 32, dim=-2), dim=1)
    assert torch.equal(heads.dequantize(), whole.dequantize())
    with pytest.raises(ValueError, match=r"not a multiple of 8 \(1-bit codes\)"):  # 4 codes would end mid-byte
        quantize(x[:, :, :4], 1, 4, dim=-2)
    with pytest.raises(ValueError, match="lengths 64 and 32 differ"):
        cat(quantize(x[:, :1, :64], 4, 32, dim=-2), quantize(x[:, 1:, :32], 4, 32, dim=-2), dim=1)
