"""TailorKV's KIVI-style quantized layer: the quantizer (hand-worked codes, half-to-even, {min, max} at 1 bit, the
s/2 error bound, constant groups, packing), the residual-window flush rules, and decode attention against an
independent float64 computation; bytes by hand."""
from __future__ import annotations

import pytest
import torch

from kvbench.attention.decode import attend
from kvbench.cache.kv_cache import KVLayer
from kvbench.cache.quantized import QuantizedLayer, cat, pack, quantize, unpack


def filled_layer(keys: torch.Tensor, values: torch.Tensor) -> KVLayer:
    layer = KVLayer()
    layer.update(keys, values)
    return layer


def reference_dequant(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Independent of the module: per group of the last dim, fp16 min and step, clamp, round half to even."""
    g = x.float().unflatten(-1, (-1, group))
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    zero, step = lo.half().float(), ((hi - lo) / (2**bits - 1)).half().float()
    codes = torch.round(torch.clamp((g - zero) / step, 0, 2**bits - 1))
    return (codes * step + zero).flatten(-2).double()


def attention64(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
    """float64 GQA decode attention: query head h*G+g reads KV head h; `[B, H_q, 1, D]` -> `[B, 1, H_q, D]`."""
    b, h_q, _, d = query.shape
    q = query.double().reshape(b, keys.shape[1], -1, d)
    probs = (q @ keys.double().transpose(-1, -2) * scaling).softmax(dim=-1)
    return (probs @ values.double()).reshape(b, 1, h_q, d)


# --- the quantizer ----------------------------------------------------------------------------------------------
def test_hand_worked_two_bit_example():
    # group 1: min 0, max 3, step 1 -> x / 1 = [0, 0.5, 1.5, 3] -> half to even [0, 0, 2, 3]
    # group 2: min -1, max 2, step 1 -> x + 1 = [0, 2.5, 1, 3] -> [0, 2, 1, 3]
    x = torch.tensor([0.0, 0.5, 1.5, 3.0, -1.0, 1.5, 0.0, 2.0])
    q = quantize(x, bits=2, group=4)
    assert unpack(q.packed, 2, 8).tolist() == [0, 0, 2, 3, 0, 2, 1, 3]
    assert q.packed.tolist() == [2 * 16 + 3 * 64, 2 * 4 + 1 * 16 + 3 * 64]  # code j at bits 2j..2j+1
    assert q.scale.dtype == q.zero.dtype == torch.float16
    assert q.zero.tolist() == [0.0, -1.0] and q.scale.tolist() == [1.0, 1.0]
    assert q.dequantize().tolist() == [0.0, 0.0, 2.0, 3.0, -1.0, 1.0, 0.0, 2.0]


def test_hand_worked_one_bit_example():
    # min 0.25, max 1, step 0.75: (x - 0.25) / 0.75 = [0, 1, 2/3, 1/3] -> [0, 1, 1, 0]; second group ties 0.5 -> 0
    x = torch.tensor([0.25, 1.0, 0.75, 0.5, 0.0, 0.5, 1.0, 0.0])
    q = quantize(x, bits=1, group=4)
    assert unpack(q.packed, 1, 8).tolist() == [0, 1, 1, 0, 0, 0, 1, 0]
    assert q.packed.tolist() == [2 + 4 + 64]  # code j at bit j
    assert q.dequantize().tolist() == [0.25, 1.0, 1.0, 0.25, 0.0, 0.0, 1.0, 0.0]


def test_one_bit_returns_group_min_or_max():
    torch.manual_seed(0)
    x = torch.randn(3, 4, 128)
    q = quantize(x, bits=1, group=64)
    xhat = q.dequantize().unflatten(-1, (2, 64))
    zero, top = q.zero.float()[..., None], (q.zero.float() + q.scale.float())[..., None]
    assert ((xhat == zero) | (xhat == top)).all()
    g = x.unflatten(-1, (2, 64))
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    tol = 2**-11 * (lo.abs() + (hi - lo))  # fp16 rounding of the stored min and step (relative 2^-11 each)
    assert (((xhat - lo).abs() < tol) | ((xhat - hi).abs() < tol)).all()
    assert ((xhat == zero).sum(-1) > 0).all() and ((xhat == top).sum(-1) > 0).all()  # both ends are used


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_error_bounded_by_half_a_step(bits):
    torch.manual_seed(bits)
    x = torch.randn(2, 3, 256) * 2
    xhat = quantize(x, bits=bits, group=64).dequantize()
    g = x.unflatten(-1, (-1, 64))
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    step = (hi - lo) / (2**bits - 1)
    err = (xhat.unflatten(-1, (-1, 64)) - g).abs()
    fp16 = 2**-11 * (lo.abs() + hi - lo)  # the stored min and step are fp16: each off by at most 2^-11 relative
    assert (err <= step / 2 + fp16).all()
    assert err.max() > step.min() / 4  # not trivially exact


def test_constant_groups_are_exact_and_finite():
    x = torch.randn(2, 192)
    x[0, :64] = 0.5
    x[1, 128:] = -3.0
    x[1, 64:128] = 0.0
    for bits in (1, 2):
        xhat = quantize(x, bits=bits, group=64).dequantize()
        assert torch.isfinite(xhat).all()
        assert (xhat[0, :64] == 0.5).all() and (xhat[1, 128:] == -3.0).all() and (xhat[1, 64:128] == 0.0).all()


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_pack_unpack_round_trip(bits):
    torch.manual_seed(bits)
    codes = torch.randint(0, 2**bits, (3, 5, 64), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 64 * bits // 8)
    assert torch.equal(unpack(packed, bits, 64), codes)


def test_cat_along_packed_and_other_dims():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 256)
    whole = quantize(x, bits=1, group=64)
    halves = cat(quantize(x[..., :128], 1, 64), quantize(x[..., 128:], 1, 64), dim=-1)  # blocks of whole groups
    assert halves.length == 256 and torch.equal(halves.packed, whole.packed)
    assert torch.equal(halves.dequantize(), whole.dequantize())
    rows = cat(quantize(x[:, :1], 1, 64), quantize(x[:, 1:], 1, 64), dim=-2)  # appending tokens to values
    assert rows.length == 256 and torch.equal(rows.dequantize(), whole.dequantize())
    assert cat(None, whole, dim=-1) is whole


# --- the layer: flush rules -------------------------------------------------------------------------------------
def sizes(layer: QuantizedLayer) -> tuple[int, int, int, int]:
    """(quantized keys, key residual, quantized values, value residual), in tokens."""
    kq = layer.k_quant.length if layer.k_quant is not None else 0
    vq = layer.v_quant.packed.shape[-2] if layer.v_quant is not None else 0
    return kq, layer.keys.shape[-2], vq, layer.values.shape[-2]


def test_residual_windows_flush_at_the_official_points():
    """The official step attends first and flushes after (`TailorKVCache.quantize`): the key block a token fills is
    quantized when the next token arrives, and each step attends 129 fp values, the oldest quantized at the next."""
    torch.manual_seed(0)
    b, h, n, d, steps = 1, 2, 300, 16, 90
    k_all, v_all = torch.randn(b, h, n + steps, d), torch.randn(b, h, n + steps, d)
    layer = QuantizedLayer.from_layer(filled_layer(k_all[:, :, :n], v_all[:, :, :n]), bits=2)
    assert sizes(layer) == (256, 44, 172, 128)  # keys: floor(300/128)*128; values: all but the last 128
    for t in range(1, steps + 1):
        layer.update(k_all[:, :, n + t - 1: n + t], v_all[:, :, n + t - 1: n + t])
        kq, kr, vq, vr = sizes(layer)
        assert (kq, kr) == ((256, 44 + t) if t <= 84 else (384, t - 84))  # the step that fills 128 attends them fp
        assert (vq, vr) == (171 + t, 129)  # 128 + the step's own value in full precision; one leaves per step
        assert layer.get_seq_length() == layer.seen_tokens == n + t
    # the flushed block equals quantizing those keys at once (blocks are whole groups), values likewise per token
    kq_ref = reference_dequant(k_all[:, :, :384].transpose(-1, -2), 2, 64)
    assert torch.equal(layer.k_quant.dequantize().double(), kq_ref)
    assert torch.equal(layer.v_quant.dequantize().double(), reference_dequant(v_all[:, :, :261], 2, 16))
    assert torch.equal(layer.keys, k_all[:, :, 384:]) and torch.equal(layer.values, v_all[:, :, 261:])


def test_the_step_that_fills_a_key_block_attends_it_in_full_precision():
    """At the official flush points the step's own attention is unquantized over its block and its 129 values."""
    torch.manual_seed(1)
    b, h, n, d = 1, 2, 255, 16  # the next token fills the second key block (keys 128 quantized + 127 fp)
    k_all, v_all = torch.randn(b, h, n + 1, d), torch.randn(b, h, n + 1, d)
    layer = QuantizedLayer.from_layer(filled_layer(k_all[:, :, :n], v_all[:, :, :n]), bits=1)
    layer.update(k_all[:, :, n:], v_all[:, :, n:])
    k_hat = torch.cat([reference_dequant(k_all[:, :, :128].transpose(-1, -2), 1, 64).transpose(-1, -2),
                       k_all[:, :, 128:].double()], dim=2)
    v_hat = torch.cat([reference_dequant(v_all[:, :, :127], 1, 16), v_all[:, :, 127:].double()], dim=2)
    query = torch.randn(1, 6, 1, 16)
    torch.testing.assert_close(attend(layer, query, 0.25).double(), attention64(query, k_hat, v_hat, 0.25),
                               rtol=0, atol=1e-5)
    layer.update(torch.randn(b, h, 1, d), torch.randn(b, h, 1, d))  # the next step carries out the flush
    assert sizes(layer) == (256, 1, 128, 129)


def test_build_keeps_no_reference_and_rejects_misuse():
    torch.manual_seed(0)
    src = filled_layer(torch.randn(1, 2, 200, 16), torch.randn(1, 2, 200, 16))
    layer = QuantizedLayer.from_layer(src, bits=1)
    held = {t.untyped_storage().data_ptr() for t in (layer.keys, layer.values)}
    assert not held & {src.keys.untyped_storage().data_ptr(), src.values.untyped_storage().data_ptr()}
    assert layer.positions is None and not layer.is_varlen
    layer.update(torch.randn(1, 2, 2, 16), torch.randn(1, 2, 2, 16))  # a fed chunk (tests/unit/test_tailorkv_feed.py)
    assert layer.get_seq_length() == layer.seen_tokens == 202
    with pytest.raises(NotImplementedError):
        layer.keep(torch.zeros(1, 2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="bits=3"):
        QuantizedLayer.from_layer(src, bits=3)


# --- the layer: attention ---------------------------------------------------------------------------------------
def decoded_layer(bits: int, n: int, steps: int, b: int = 2, h: int = 2, d: int = 16):
    torch.manual_seed(bits * 1000 + n)
    k_all, v_all = torch.randn(b, h, n + steps, d), torch.randn(b, h, n + steps, d)
    layer = QuantizedLayer.from_layer(filled_layer(k_all[:, :, :n], v_all[:, :, :n]), bits=bits)
    for t in range(n, n + steps):
        layer.update(k_all[:, :, t: t + 1], v_all[:, :, t: t + 1])
    return layer, k_all, v_all


@pytest.mark.parametrize("bits", [1, 2])
def test_attend_matches_float64_reference(bits):
    layer, k_all, v_all = decoded_layer(bits, n=300, steps=90)  # T = 390: keys 384 + 6, values 261 + 129
    k_hat = torch.cat([reference_dequant(k_all[:, :, :384].transpose(-1, -2), bits, 64).transpose(-1, -2),
                       k_all[:, :, 384:].double()], dim=2)
    v_hat = torch.cat([reference_dequant(v_all[:, :, :261], bits, 16), v_all[:, :, 261:].double()], dim=2)
    query = torch.randn(2, 6, 1, 16)  # GQA: 6 query heads over 2 KV heads
    out = attend(layer, query, 0.25)
    assert out.shape == (2, 1, 6, 16) and out.dtype == query.dtype
    torch.testing.assert_close(out.double(), attention64(query, k_hat, v_hat, 0.25), rtol=0, atol=1e-5)
    exact = attention64(query, k_all, v_all, 0.25)
    assert (out.double() - exact).abs().max() > 1e-3  # the quantization is visible


def test_eight_bits_is_close_to_exact():
    layer, k_all, v_all = decoded_layer(8, n=300, steps=90)
    query = torch.randn(2, 6, 1, 16)
    torch.testing.assert_close(attend(layer, query, 0.25).double(), attention64(query, k_all, v_all, 0.25),
                               rtol=0, atol=5e-3)  # observed 2e-3


def test_short_prompt_stays_full_precision():
    layer, k_all, v_all = decoded_layer(1, n=100, steps=20)  # 120 < 128: nothing flushes
    assert layer.k_quant is None and layer.v_quant is None
    query = torch.randn(2, 6, 1, 16)
    torch.testing.assert_close(attend(layer, query, 0.25).double(), attention64(query, k_all, v_all, 0.25),
                               rtol=0, atol=1e-6)


# --- accounting -------------------------------------------------------------------------------------------------
def test_nbytes_by_hand():
    b, h, d, n = 1, 2, 64, 256
    src = filled_layer(torch.randn(b, h, n, d).half(), torch.randn(b, h, n, d).half())
    layer = QuantizedLayer.from_layer(src, bits=1, group=64, residual=128)
    assert sizes(layer) == (256, 0, 128, 128)
    keys = 2 * 64 * 256 // 8 + 2 * (2 * 64 * (256 // 64) * 2)  # packed 1-bit codes + fp16 scale and zero
    values = 2 * 128 * 64 // 8 + 2 * (2 * 128 * (64 // 64) * 2)  # 128 quantized tokens, one group per token
    residual = 2 * 128 * 64 * 2  # 128 fp16 value tokens (the key residual is empty)
    assert (keys, values, residual) == (6144, 3072, 32768)
    assert layer.nbytes() == keys + values + residual
    assert layer.entries_per_head() == [256, 256] and layer.get_seq_length() == 256
    assert layer.get_mask_sizes(1) == (257, 0)
