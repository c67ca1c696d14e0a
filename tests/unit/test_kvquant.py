"""KVQuant-style keys (kvbench/methods/kvquant.py, kvbench/cache/kvquant.py). The authors' code needs CUDA, so the
store is checked against a direct recomputation of the paper's equations written here (sorting for the thresholds,
round-to-nearest codes, explicit rotation matrices), its bytes are hand-counted, and a generation runs on it."""
from __future__ import annotations

import pytest
import torch

import kvbench.methods  # noqa: F401
from kvbench.cache.kv_cache import KVLayer
from kvbench.cache.kvquant import KVQuantLayer, outliers_per_side
from kvbench.engine.batching import generate
from kvbench.models import AttentionCapture
from kvbench.models.rotary import Rotary
from kvbench.registry import METHODS
from tests.unit.tiny import prompt, tiny_model

THETA = Rotary(1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))  # "half" layout, D = 16


def rope(x: torch.Tensor) -> torch.Tensor:
    """Post-RoPE vectors `[B, H, n, D]` at positions 0..n-1 through explicit rotation matrices."""
    return torch.einsum("pij,bhpj->bhpi", THETA.matrix(torch.arange(x.shape[2]), x.shape[-1]), x)


def quantize_dequantize(x: torch.Tensor, bits: int) -> torch.Tensor:
    """One group `[..., g]`: min/max range (fp16 scale and zero, as the shared quantizer stores them), nearest code."""
    zero = x.amin(dim=-1, keepdim=True).half().float()
    scale = ((x.amax(dim=-1, keepdim=True) - x.amin(dim=-1, keepdim=True)) / (2**bits - 1)).half().float()
    return ((x - zero) / scale).clamp(0, 2**bits - 1).round() * scale + zero


def expected(vectors: torch.Tensor, bits: int, group: int, share: float) -> torch.Tensor:
    """The paper's dense-and-sparse for each vector `[L]` of `vectors` `[..., L]`, written out with a sort."""
    vectors = vectors.contiguous()
    out = torch.empty_like(vectors)
    k = outliers_per_side(vectors.shape[-1], share)
    for i, v in enumerate(vectors.reshape(-1, vectors.shape[-1])):
        order = v.argsort()
        low, high = v[order[k]], v[order[-k - 1]]  # the thresholds: the range once k entries left each end
        dense = v.clamp(low, high)
        whole = len(v) // group * group
        back = torch.cat([quantize_dequantize(dense[:whole].view(-1, group), bits).flatten(), dense[whole:]])
        if k:
            back[order[:k]], back[order[-k:]] = v[order[:k]], v[order[-k:]]  # outliers exactly
        out.view(-1, vectors.shape[-1])[i] = back
    return out


@pytest.mark.parametrize("bits, group, share, n", [(4, 16, 0.05, 40), (2, 8, 0.0, 24), (4, 16, 0.2, 37)])
def test_keys_are_quantized_per_channel_before_rope_and_values_per_token(bits, group, share, n):
    g = torch.Generator().manual_seed(bits + n)
    pre = torch.randn(1, 2, n, 16, generator=g)
    pre[:, :, :, 3] *= 10  # an outlier channel, as KVQuant finds in pre-RoPE keys
    values = torch.randn(1, 2, n, 16, generator=g)
    layer = KVLayer()
    layer.update(rope(pre), values)
    stored = KVQuantLayer.from_layer(layer, THETA, bits, group, share)
    keys_back, values_back = stored.prompt_kv()
    want_keys = rope(expected(pre.transpose(-1, -2), bits, group, share).transpose(-1, -2))
    torch.testing.assert_close(keys_back, want_keys, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(values_back, expected(values, bits, min(group, 16), share), rtol=1e-5, atol=1e-5)
    post_rope = expected(rope(pre).transpose(-1, -2), bits, group, share).transpose(-1, -2)
    assert not torch.allclose(keys_back, post_rope, atol=1e-3)  # quantized before RoPE, not after: it shows


def test_a_layer_holds_the_stored_parts_bytes():
    """2 heads, 40 tokens, D = 16, fp32, 4 bits, group 16, outliers 0.05. Keys: 32 channel vectors of 40 tokens,
    k = int(40 x 0.025) = 1 outlier each side; 32 tokens in 2 groups (codes 32 x 32 / 2 bytes, fp16 scale + zero per
    group), the last 8 tokens fp32. Values: 80 token vectors of 16 channels, k = max(1, int(0.4)) = 1 each side, one
    group each. Outliers: fp32 value + int32 offset."""
    g = torch.Generator().manual_seed(0)
    layer = KVLayer()
    layer.update(torch.randn(1, 2, 40, 16, generator=g), torch.randn(1, 2, 40, 16, generator=g))
    stored = KVQuantLayer.from_layer(layer, THETA, 4, 16, 0.05)
    keys = 32 * 32 // 2 + 32 * 2 * 2 * 2 + 32 * 8 * 4 + 32 * 2 * 8
    values = 80 * 16 // 2 + 80 * 2 * 2 + 80 * 2 * 8
    assert stored.nbytes() == keys + values
    assert stored.nbytes() < layer.nbytes() / 2


def test_a_generation_runs_on_the_store_and_keeps_every_token():
    model, ids = tiny_model("llama", layers=2), prompt(70)
    seen = []
    with AttentionCapture(model) as capture:
        def on_logits(t, logits):
            seen.append([(type(layer).__name__, layer.get_seq_length()) for layer in capture.cache.layers])
        gen = generate(model, None, METHODS["kvquant"](group_size=16), capture, ids, None, 4, on_logits=on_logits,
                       eos_ids=set())
    assert len(gen.token_ids) == 4
    assert seen[0] == [("KVQuantLayer", 70)] * 2 and seen[-1] == [("KVQuantLayer", 73)] * 2
    assert gen.kv_bytes < gen.full_kv_bytes / 2
    assert gen.kept_per_head == [[70, 70], [70, 70]]  # every prompt entry kept
