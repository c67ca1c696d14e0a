"""The engine's one decode attention (kvbench.attention.decode) against a direct per-sequence, per-head eager
recomputation in float64: hand-built caches whose lengths differ per sequence and per KV head, GQA, per-sequence
temperature, soft cap, ALiBi over recorded (non-contiguous) positions, a sliding window, and the logits evictors
read; then every cache layer type (dense, per-head variable, quantized, offloaded) in one call equals each alone."""
from __future__ import annotations

import pytest
import torch

from kvbench.attention import decode as attention
from kvbench.attention.decode import attend, decode_attention
from kvbench.cache.kv_cache import DecodeKV, KVLayer
from kvbench.cache.ledger import TransferLedger
from kvbench.cache.offloaded import OffloadedLayer
from kvbench.cache.quantized import QuantizedLayer
from kvbench.cache.varlen import VarlenLayer

H_KV, G, D = 2, 3, 8


def ragged_sequence(gen: torch.Generator, lengths: list[int]):
    """One sequence's cache as plain per-head lists (the reference's view) and as a padded `DecodeKV` (the newest
    entry last in each head); positions are sorted, with gaps (evicted entries), the newest the largest."""
    longest = max(lengths)
    keys, values = torch.zeros(1, H_KV, longest, D), torch.zeros(1, H_KV, longest, D)
    valid = torch.zeros(1, H_KV, longest, dtype=torch.bool)
    positions = torch.zeros(1, H_KV, longest, dtype=torch.long)
    heads = []
    now = 500
    for h, n in enumerate(lengths):
        k, v = torch.randn(n, D, generator=gen) * 2, torch.randn(n, D, generator=gen)
        pos = torch.cat([torch.randperm(now, generator=gen)[: n - 1].sort().values, torch.tensor([now])])
        heads.append((k, v, pos))
        at = torch.arange(longest - n, longest)  # right-aligned: padding first, the newest entry last
        keys[0, h, at], values[0, h, at], valid[0, h, at], positions[0, h, at] = k, v, True, pos
    return heads, DecodeKV(keys, values, valid, positions)


def reference(query, heads, scale, softcap=None, slopes=None, window=None):
    """`[H_q, D]` float64 output of one sequence, each query head over its KV head's own entries, eagerly."""
    out = torch.zeros(H_KV * G, D, dtype=torch.float64)
    logits_of = {}
    for h, (k, v, pos) in enumerate(heads):
        for g in range(G):
            j = h * G + g
            logits = (query[j].double() @ k.double().T) * scale
            if softcap is not None:
                logits = softcap * torch.tanh(logits / softcap)
            if slopes is not None:
                logits = logits + slopes[j].double() * (pos - pos[-1]).double()
            if window is not None:
                logits = logits.masked_fill(pos <= pos[-1] - window, float("-inf"))
            logits_of[j] = logits
            out[j] = logits.softmax(-1) @ v.double()
    return out, logits_of


@pytest.mark.parametrize("padded", [True, False])  # one padded block (CUDA without flash) / per sequence (CPU)
@pytest.mark.parametrize("shaping", [{}, {"softcap": 0.7}, {"slopes": True}, {"window": 200},
                                     {"softcap": 1.5, "slopes": True, "window": 300}])
def test_one_call_equals_each_sequence_and_head_alone(shaping, padded):
    gen = torch.Generator().manual_seed(len(shaping))
    lengths = [[5, 17], [40, 1], [23, 23], [3, 30]]  # per sequence, per KV head
    sequences = [ragged_sequence(gen, n) for n in lengths]
    query = torch.randn(len(lengths), H_KV * G, 1, D, generator=gen)
    scales = [0.35, 0.2, 0.5, 0.35 * 0.6]  # a per-sequence temperature (BUZZ's log n) scales one sequence
    slopes = 2.0 ** -torch.arange(1, H_KV * G + 1).float() if shaping.get("slopes") else None
    kw = dict(softcap=shaping.get("softcap"), window=shaping.get("window"))
    out, logits = decode_attention(query, [kv for _, kv in sequences], scales, alibi_slopes=slopes,
                                   return_logits=True, padded=padded, **kw)
    assert out.shape == (4, 1, H_KV * G, D) and logits.shape[:2] == (4, H_KV * G)
    for s, (heads, kv) in enumerate(sequences):
        expected, expected_logits = reference(query[s, :, 0], heads, scales[s], slopes=slopes, **kw)
        torch.testing.assert_close(out[s, 0].double(), expected, rtol=1e-5, atol=1e-6)
        for j, row in expected_logits.items():  # the logits an evictor reads: its head's entries, in cache order
            held = torch.zeros(logits.shape[-1], dtype=torch.bool)
            held[: kv.keys.shape[2]] = kv.valid[0, j // G]
            ours = logits[s, j][held]
            assert torch.isinf(logits[s, j][~held]).all()
            torch.testing.assert_close(ours.double(), row, rtol=1e-5, atol=1e-5)
    if shaping.get("window"):  # the window really hid entries somewhere
        assert any((pos <= pos[-1] - shaping["window"]).any() for heads, _ in sequences for *_, pos in heads)


@pytest.mark.parametrize("scales", [[0.35, 0.2, 0.5, 0.35 * 0.6], [0.35] * 4])
def test_fused_path_equals_each_sequence_and_head_alone(scales):
    """CUDA's fused (sdpa) path for logit-free steps, run here on the CPU: GQA as G query rows per KV head, padding
    masked, a per-sequence scale through the query (or the shared one as sdpa's own scale)."""
    gen = torch.Generator().manual_seed(11)
    sequences = [ragged_sequence(gen, n) for n in [[5, 17], [40, 1], [23, 23], [3, 30]]]
    query = torch.randn(4, H_KV * G, 1, D, generator=gen)
    kvs = [kv for _, kv in sequences]
    out = attention._sdpa(query, *attention.pad(kvs, positions=False)[:3],
                          attention._scales(scales, kvs, "cpu"), attention._uniform(scales))
    assert out.shape == (4, 1, H_KV * G, D)
    for s, (heads, _) in enumerate(sequences):
        torch.testing.assert_close(out[s, 0].double(), reference(query[s, :, 0], heads, scales[s])[0],
                                   rtol=1e-5, atol=1e-6)


def test_padding_never_changes_a_sequence():
    """A sequence attended with much longer ones equals it attended alone (padding is masked, not attended)."""
    gen = torch.Generator().manual_seed(7)
    short, long = ragged_sequence(gen, [4, 2]), ragged_sequence(gen, [90, 60])
    query = torch.randn(2, H_KV * G, 1, D, generator=gen)
    together, _ = decode_attention(query, [short[1], long[1]], 0.3, padded=True)
    alone, _ = decode_attention(query[:1], [short[1]], 0.3)
    torch.testing.assert_close(together[:1], alone, rtol=1e-6, atol=1e-7)


def filled(n: int, seed: int, heads: int = H_KV) -> KVLayer:
    gen = torch.Generator().manual_seed(seed)
    layer = KVLayer()
    layer.update(torch.randn(1, heads, n, D, generator=gen), torch.randn(1, heads, n, D, generator=gen))
    return layer


def every_layer_type() -> list[KVLayer]:
    """A dense layer, an Ada-KV per-head layer, a quantized and an offloaded (TailorKV) layer, each one decoded
    token later, of different lengths."""
    dense = filled(70, 1)
    dense.keep(torch.tensor([[[0, 3, 9, 40, 69]] * H_KV]))
    varlen = VarlenLayer.from_selection(filled(120, 2), [torch.tensor([1, 5, 119]), torch.arange(0, 120, 3)])
    quantized = QuantizedLayer.from_layer(filled(200, 3), bits=2, group=8, residual=64)
    offloaded = OffloadedLayer.from_layer(filled(150, 4), 4, 12, 20, 3, TransferLedger())
    layers = [dense, varlen, quantized, offloaded]
    gen = torch.Generator().manual_seed(5)
    for layer in layers:
        layer.update(torch.randn(1, H_KV, 1, D, generator=gen), torch.randn(1, H_KV, 1, D, generator=gen))
    return layers


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("slopes", [None, 2.0 ** -torch.arange(1, H_KV * G + 1).float()])
def test_every_layer_type_in_one_call_equals_each_alone(slopes, padded):
    query = torch.randn(4, H_KV * G, 1, D, generator=torch.Generator().manual_seed(6))
    alone = [attend(layer, query[i:i + 1], 0.3, softcap=2.0, alibi_slopes=slopes)
             for i, layer in enumerate(every_layer_type())]
    layers = every_layer_type()  # (the offloaded layer frees what it fetched for a query after each step)
    together, _ = decode_attention(query, [layer.decode_kv(query[i:i + 1]) for i, layer in enumerate(layers)], 0.3,
                                   softcap=2.0, alibi_slopes=slopes, padded=padded)
    torch.testing.assert_close(together, torch.cat(alone), rtol=1e-6, atol=1e-7)


def test_varlen_alibi_uses_each_kept_entrys_position():
    """Ada-KV under ALiBi: each head's kept prompt entries are biased by their own original positions."""
    layer = VarlenLayer.from_selection(filled(50, 8), [torch.tensor([2, 30, 49]), torch.tensor([0, 10, 20, 40, 49])])
    new_k, new_v = torch.randn(1, H_KV, 1, D), torch.randn(1, H_KV, 1, D)
    layer.update(new_k, new_v)
    query = torch.randn(1, H_KV * G, 1, D)
    slopes = torch.full((H_KV * G,), 0.25)
    ours = attend(layer, query, 0.3, alibi_slopes=slopes)
    source = filled(50, 8)
    heads = []
    for h, idx in enumerate([torch.tensor([2, 30, 49]), torch.tensor([0, 10, 20, 40, 49])]):
        k = torch.cat([source.keys[0, h, idx], new_k[0, h]])
        v = torch.cat([source.values[0, h, idx], new_v[0, h]])
        heads.append((k, v, torch.cat([idx, torch.tensor([50])])))
    expected, _ = reference(query[0, :, 0], heads, 0.3, slopes=slopes)
    torch.testing.assert_close(ours[0, 0].double(), expected, rtol=1e-5, atol=1e-6)


def test_a_query_that_does_not_fit_is_refused():
    kv = DecodeKV(torch.zeros(1, H_KV, 4, D), torch.zeros(1, H_KV, 4, D))
    with pytest.raises(ValueError, match="decode attention: query"):
        decode_attention(torch.zeros(2, H_KV * G, 1, D), [kv], 0.3)


def varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, softcap=0.0):
    """flash-attn's `flash_attn_varlen_func` as documented, segment by segment (one query token each here), in
    PyTorch: query heads over `k.shape[1]` KV heads, soft cap applied to the scaled logits."""
    out = torch.empty_like(q)
    for i in range(len(cu_q) - 1):
        qs, ks = q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]]  # [1, G, D], [n, 1, D]
        logits = torch.einsum("qgd,kd->gqk", qs.float(), ks[:, 0].float()) * softmax_scale
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        out[cu_q[i]:cu_q[i + 1]] = torch.einsum("gqk,kd->qgd", logits.softmax(-1),
                                                v[cu_k[i]:cu_k[i + 1], 0].float()).to(q.dtype)
    return out


def test_flash_layout_equals_the_torch_path(monkeypatch):
    """The CUDA path's segment layout (valid entries flattened per (sequence, KV head), offsets, per-sequence scale
    folded into the query, soft cap) checked on the CPU with flash-attn's documented semantics in PyTorch; the
    kernel itself is checked in tests/gpu."""
    from kvbench.attention import decode as attention

    monkeypatch.setattr(attention, "_flash_varlen", lambda: varlen_reference)
    layers = every_layer_type()
    query = torch.randn(4, H_KV * G, 1, D, generator=torch.Generator().manual_seed(9))
    kvs = [layer.decode_kv(query[i:i + 1]) for i, layer in enumerate(layers)]
    scales = torch.tensor([0.3, 0.2, 0.3, 0.25])
    flash = attention._flash(query, kvs, scales, 1.5)
    torch_path, _ = decode_attention(query, kvs, scales.tolist(), softcap=1.5)
    torch.testing.assert_close(flash, torch_path, rtol=1e-5, atol=1e-6)
