"""leverage_score scores pre-RoPE keys, so each cached key must be rotated back from the position it was encoded at.
After a prefill those are 0..n-1; in a layer compressed again while decoding (`decode_compression`) or in a
wrapper's subset (chunk, block, compose) they are not, and rotating back from the slot gave other keys and other
kept sets (every head of the embedded model differed at its second compression). Checked here against keys rotated
back with the model's own rotary embedding (transformers' `rotary_emb`, the inverse rotation written out) and the
leverage formula x_i (XᵀX + 1e-2 I)⁻¹ x_iᵀ in float64."""
from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import rotate_half

import kvbench.methods  # noqa: F401
from kvbench.cache import KVCache
from kvbench.engine.generation import prefill
from kvbench.engine.recompress import DecodeCompression
from kvbench.methods.base import LayerView
from kvbench.methods.leverage_score import prerope_keys
from kvbench.methods.wrappers import sub_view
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from tests.unit.tiny import decoding_selections, prompt, tiny_model

N_PROMPT, NEW, EVERY, TARGET, SKETCH = 60, 40, 8, 32, 8


def unrotated(model, keys, positions):
    """`[1, H, n, D]` keys encoded at `positions` `[1, H, n]`, rotated back by the model's own (cos, sin)."""
    heads = []
    for h in range(keys.shape[1]):
        cos, sin = model.model.rotary_emb(keys[:, h], positions[:, h])  # [1, n, D]
        heads.append(keys[:, h].double() * cos.double() - rotate_half(keys[:, h].double()) * sin.double())
    return torch.stack(heads, dim=1)


def leverage(keys, sketch):
    """`[1, H, n, D]` pre-RoPE keys, `[1, H, D, k]` sketch -> `[1, H, n]`, float64."""
    x = (keys - keys.mean(dim=2, keepdim=True)) @ sketch.double()
    gram = x.transpose(-1, -2) @ x + 1e-2 * torch.eye(x.shape[-1], dtype=torch.float64)
    return torch.einsum("bhnk,bhkj,bhnj->bhn", x, torch.linalg.inv(gram), x)


def test_under_decode_compression_each_key_is_rotated_back_from_its_own_position():
    """At every compression while decoding, the kept entries are the top leverage of the layer's keys rotated back
    from the positions the cache recorded for them (the kept scores' multiset is compared: ties aside)."""
    model, method = tiny_model("llama"), METHODS["leverage_score"](sketch_dimension=SKETCH)
    calls = decoding_selections(  # (the prefill's selection sees positions 0..n-1)
        model, method, prompt(N_PROMPT), TARGET, NEW, DecodeCompression(EVERY, TARGET),
        lambda capture, method, view, n_keep, idx: (view.keys.clone(), capture.cache.layers[view.layer_idx].positions
                                                    .clone(), method.sketch(view), n_keep, idx))
    assert len(calls) >= 4 * model.config.num_hidden_layers
    for keys, positions, sketch, n_keep, idx in calls:
        assert not torch.equal(positions[0, 0], torch.arange(keys.shape[2]))  # not the slots
        scores = leverage(unrotated(model, keys, positions), sketch)
        chosen = scores.gather(-1, idx).sort(-1).values
        best = scores.topk(n_keep, dim=-1).values.sort(-1).values
        torch.testing.assert_close(chosen, best, rtol=1e-5, atol=1e-7)


def test_a_wrappers_subset_keeps_each_keys_position():
    """`sub_view` (chunk, block, compose's second stage): the subset's pre-RoPE keys are the layer's, gathered."""
    model = tiny_model("llama", layers=1)
    cache = KVCache()
    with AttentionCapture(model, window=0) as capture, torch.no_grad():
        prefill(model, prompt(N_PROMPT), cache)
        view = LayerView(0, 1, cache.layers[0].keys, cache.layers[0].values, None, 1.0, rotary=capture.rotary[0])
    idx = torch.stack([torch.randperm(N_PROMPT, generator=torch.Generator().manual_seed(h))[:20].sort().values
                       for h in range(view.keys.shape[1])])[None]  # [1, H_kv, 20], a subset per head
    want = unrotated(model, view.keys, torch.arange(N_PROMPT).expand_as(view.keys[..., 0]))
    d = view.keys.shape[-1]
    torch.testing.assert_close(prerope_keys(sub_view(view, idx)).double(),
                               want.gather(2, idx[..., None].expand(-1, -1, -1, d)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(prerope_keys(view).double(), want, rtol=1e-5, atol=1e-5)  # a prefill: 0..n-1
