"""pos-shift: attention sees the kept keys at consecutive cache slots, as if RoPE had been applied there afresh.

The reference rotates each token's pre-RoPE key at its slot directly (fp32, then bf16: a fresh RoPE); the cache only
ever stored the key its token was computed with. After hundreds of evictions in bf16 the two must still agree to
bf16 precision, where chaining one re-rotation per eviction drifts (the failure this protects against).
"""
from __future__ import annotations

import torch

from kvbench.cache.kv_cache import KVLayer
from kvbench.cache.rerotate import rotate, rotate_half

D, H = 64, 2
INV_FREQ = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))


def rope(pre: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Fresh RoPE of pre-RoPE keys `[H, T, D]` at positions `[T]`, fp32 (HF's rotate-half layout)."""
    angles = pos.float()[:, None] * INV_FREQ
    angles = torch.cat([angles, angles], dim=-1)
    return pre * angles.cos() + rotate_half(pre) * angles.sin()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_shift_equals_fresh_rope_at_the_slots_after_many_evictions_in_bf16():
    torch.manual_seed(0)
    n_prompt, steps = 100, 500
    pre = torch.randn(H, n_prompt + steps, D)  # token j's pre-RoPE key
    layer = KVLayer()
    layer.update(rope(pre[:, :n_prompt], torch.arange(n_prompt)).to(torch.bfloat16)[None],
                 torch.zeros(1, H, n_prompt, D, dtype=torch.bfloat16))
    layer.shift_inv_freq = INV_FREQ
    tokens = list(range(n_prompt))  # token ids in cache order
    chained = layer.keys[0].clone()  # the drifting alternative: re-rotate the stored keys at every eviction
    errors, chained_errors = [], []
    for step in range(steps):
        keep = torch.tensor([0] + list(range(2, len(tokens))))  # evict slot 1: every later key moves one slot
        layer.keep(keep.expand(1, H, -1))
        tokens = [tokens[i] for i in keep.tolist()]
        chained = rotate(chained[:, keep], -torch.ones(H, len(tokens)).masked_fill(keep[None] < 1, 0), INV_FREQ)
        slot = len(tokens)  # the new token is computed at its slot (layer 0's length), as decode does
        token = n_prompt + step
        layer.next_position = slot
        keys, _ = layer.update(rope(pre[:, token: token + 1], torch.tensor([slot])).to(torch.bfloat16)[None],
                               torch.zeros(1, H, 1, D, dtype=torch.bfloat16))
        tokens.append(token)
        chained = torch.cat([chained, keys[0, :, -1:]], dim=1)
        fresh = rope(pre[:, tokens], torch.arange(len(tokens))).to(torch.bfloat16)
        errors.append(rel_err(keys[0], fresh))
        chained_errors.append(rel_err(chained, fresh))
    assert max(errors) < 0.01  # about one bf16 rounding (2^-9 relative), at every step
    assert max(errors[-100:]) < 1.5 * max(errors[:100])  # no drift with the number of evictions
    assert chained_errors[-1] > 5 * max(errors)  # the test tells the two apart


def test_each_layer_places_its_query_at_its_own_cache_length():
    """Two layers keep different numbers of entries (per-layer budgets). The token is computed at one position P
    for both; each layer's attention logits must equal fresh RoPE with the query at that layer's own length."""
    torch.manual_seed(1)
    q_pre = torch.randn(H, 1, D)
    for kept, p in [(30, 30), (10, 30), (7, 123)]:
        pre = torch.randn(H, kept + 1, D)  # kept entries + the new token
        layer = KVLayer()
        orig = torch.randperm(500)[:kept].sort().values  # original positions of the kept tokens
        layer.update(rope(pre[:, :kept], orig)[None], torch.zeros(1, H, kept, D))
        layer.positions = orig.expand(1, H, kept).clone()  # as an eviction would leave them
        layer.shift_inv_freq = INV_FREQ
        layer.next_position = p
        keys, _ = layer.update(rope(pre[:, kept:], torch.tensor([p]))[None], torch.zeros(1, H, 1, D))
        ours = rope(q_pre, torch.tensor([p])) @ keys[0].transpose(-1, -2)  # the query is rotated at P
        own = rope(q_pre, torch.tensor([kept])) @ rope(pre, torch.arange(kept + 1)).transpose(-1, -2)
        torch.testing.assert_close(ours, own, rtol=1e-4, atol=1e-4)
