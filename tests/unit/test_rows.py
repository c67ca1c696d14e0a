"""Shared rows (kvbench/cache/rows.py) against the independent reference, plain per-sample layers: the same entries,
positions and bytes after in-place appends, the same attention output up to sdpa's batch rounding, and rows given
back (and long rows dropped) when samples leave a batch."""
from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import kvbench.methods  # noqa: F401
from kvbench.engine.batching import BatchedDecoder, Decoding, Request
from kvbench.cache import KVCache
from kvbench.cache.rows import Rows, RowLayer, append
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from tests.unit.tiny import prompt, tiny_model

H, D = 2, 8


class Attention:  # what sdpa_attention_forward reads of an attention module (GQA: 6 query heads, 2 KV heads)
    num_key_value_groups, is_causal, training, scaling = 3, True, False, D ** -0.5


def plain_layer(n: int, seed: int) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    cache = KVCache()
    cache.update(torch.randn(1, H, n, D, generator=g), torch.randn(1, H, n, D, generator=g), 0)
    return cache


def test_rows_hold_what_plain_layers_hold_and_attend_alike():
    lengths, new = [5, 9, 7], 4
    plain = [plain_layer(n, i) for i, n in enumerate(lengths)]
    rows = Rows(plain[0].layers[0], Rows.capacity_for(plain[0].layers[0], new))
    in_rows = [rows.take(plain_layer(n, i).layers[0]) for i, n in enumerate(lengths)]
    g = torch.Generator().manual_seed(9)
    for step in range(new - 1):
        k, v = torch.randn(3, H, 1, D, generator=g), torch.randn(3, H, 1, D, generator=g)
        members = range(3) if step < new - 2 else range(2)  # the last sample skips a step
        for i in members:
            plain[i].update(k[i:i + 1], v[i:i + 1], 0)
        append([in_rows[i] for i in members], [k[i] for i in members], [v[i] for i in members])
    for cache, layer in zip(plain, in_rows):
        ref = cache.layers[0]
        assert torch.equal(layer.keys, ref.keys) and torch.equal(layer.values, ref.values)
        assert torch.equal(layer.positions, ref.positions) and layer.nbytes() == ref.nbytes()
        assert layer.seen_tokens == ref.seen_tokens
    assert len({layer.keys.shape[-2] for layer in in_rows}) > 1  # rows of different lengths: the mask is used
    query = torch.randn(3, 6, 1, D, generator=g)
    keys, values, mask = rows.attention_inputs()
    together = sdpa_attention_forward(Attention, query, keys, values, mask, scaling=Attention.scaling)[0]
    for i, cache in enumerate(plain):
        alone = sdpa_attention_forward(Attention, query[i:i + 1], cache.layers[0].keys, cache.layers[0].values,
                                       None, scaling=Attention.scaling)[0]
        torch.testing.assert_close(together[i:i + 1], alone, rtol=1e-5, atol=1e-6)


def test_rows_grow_and_give_rows_back():
    layers = [plain_layer(6, i).layers[0] for i in range(3)]
    rows = Rows(layers[0], 64)
    taken = [rows.take(layer) for layer in layers]
    assert len(rows.owners) == 3 and all(isinstance(t, RowLayer) for t in taken)
    assert all(torch.equal(t.keys, layer.keys) for t, layer in zip(taken, layers))  # views survived the growth
    taken[1].release()
    again = rows.take(plain_layer(4, 7).layers[0])
    assert again.row == 1 and len(rows.owners) == 3  # the free row is reused, nothing grows


def test_a_long_full_cache_does_not_linger_in_rows():
    """A full-cache sample's rows (capacity of its whole prompt) are dropped once it leaves; the compressed samples
    keep theirs, sized for their budget."""
    model = tiny_model("llama", layers=2)
    requests = [Request(prompt(300, seed=0), None, 2, tag="full")]
    requests += [Request(prompt(150, seed=i), 32, 8, tag=i) for i in range(1, 4)]
    requests[0].decoding = Decoding(METHODS["full"]())
    snapkv = METHODS["snapkv"](window=8)
    with AttentionCapture(model) as capture:
        decoder = BatchedDecoder(model, None, snapkv, capture, 4, eos_ids=set())
        for request, generation in decoder.run(requests):
            capacities = {key[1] for key in decoder.rows}
            if request.tag == "full":
                assert capacities and max(capacities) < 300  # only the compressed samples' rows remain
    assert decoder.rows == {}
