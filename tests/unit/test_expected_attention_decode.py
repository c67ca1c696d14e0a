"""Expected Attention compressed again while decoding (`decode_compression`): its future queries follow the tokens
the sequence has seen, not the layer's length (after evictions a layer holds far fewer entries than the tokens it has
seen). With precomputed statistics (`stats`, pre-RoPE) placing them at the layer's length rotated them by the wrong
angles and kept other entries. From the window's queries the offset cancelled (RoPE is relative: queries rotated back
from positions d too early and rotated forward to positions d too early give the same statistics), so that path is
checked here for its own sake.

The reference never touches kvbench's capture or rotary code: pre-RoPE queries are the attention module's q_proj of
the hidden states it received at each decode step (or the statistics file's), the averaged RoPE matrix is built as
kvpress builds it (cos I + sin P over the model's own rotary embedding) at the positions that follow the tokens seen,
all in float64."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import kvbench.methods  # noqa: F401
from kvbench.engine.recompress import DecodeCompression
from kvbench.registry import METHODS
from tests.unit.tiny import decoding_selections, prompt, tiny_model

N_PROMPT, NEW, EVERY, TARGET, BUDGET, WINDOW, N_SINK, N_FUTURE = 60, 40, 8, 32, 24, 12, 4, 512


def peaked_model():
    """Random init gives logits near 0 (every key alike to any query); scaled-up projections make the rotation
    matter."""
    model = tiny_model("llama", layers=2)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6)
            layer.self_attn.k_proj.weight.mul_(6)
    return model


def window_statistics(model, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-RoPE mean `[1, H_q, D]` and covariance of the queries of the decode steps' attention inputs `hidden`."""
    attn, cfg = model.model.layers[layer].self_attn, model.config
    q = (hidden.double() @ attn.q_proj.weight.double().T).view(1, -1, cfg.num_attention_heads, attn.head_dim)
    q = q.transpose(1, 2)
    mu = q.mean(dim=2)
    return mu, torch.einsum("bnsi,bnsj->bnij", q - mu[:, :, None], q - mu[:, :, None]) / q.shape[2]


@torch.no_grad()
def reference_scores(model, mu, cov, keys, values, seen: int) -> torch.Tensor:
    """`[1, H_kv, n]` Expected Attention of a layer's entries from pre-RoPE query statistics and the count of tokens
    the sequence has seen (the future positions are seen..seen+511)."""
    h_q, h_kv, d = mu.shape[1], keys.shape[1], keys.shape[-1]
    cos, sin = (t[0].double() for t in model.model.rotary_emb(keys, torch.arange(seen, seen + N_FUTURE)[None]))
    eye, p = torch.eye(d, dtype=torch.float64), torch.zeros(d, d, dtype=torch.float64)
    p[d // 2:, : d // 2], p[: d // 2, d // 2:] = torch.eye(d // 2), -torch.eye(d // 2)
    r = (cos[:, None] * eye + sin[:, None] * p).mean(dim=0)
    mu, cov = mu.double() @ r.T, r @ cov.double() @ r.T
    k = keys[:, :, N_SINK:].double().repeat_interleave(h_q // h_kv, dim=1)
    logits = torch.einsum("bhd,bhnd->bhn", mu, k) / d ** 0.5 + torch.einsum("bhnd,bhde,bhne->bhn", k, cov, k) / d / 2
    scores = logits.softmax(-1).view(1, h_kv, h_q // h_kv, -1).mean(2) * values[:, :, N_SINK:].double().norm(dim=-1)
    return torch.cat([torch.full((1, h_kv, N_SINK), float(scores.max()) + 1, dtype=torch.float64), scores], dim=-1)


@pytest.mark.parametrize("source", ["stats", "window"])
def test_under_decode_compression_the_future_queries_follow_the_tokens_seen(source, tmp_path):
    """At every compression while decoding, the method's scores are the reference's and the kept entries their top
    (the kept scores' multiset is compared: ties aside)."""
    model, layers = peaked_model(), range(2)
    method = METHODS["expected_attention"](window=WINDOW)
    if source == "stats":
        g = torch.Generator().manual_seed(1)
        mu, a = torch.randn(len(layers), 6, 16, generator=g), torch.randn(len(layers), 6, 16, 16, generator=g) / 4
        save_file({"query_mean": mu, "query_cov": a @ a.transpose(-1, -2)}, str(tmp_path / "stats.safetensors"))
        method = METHODS["expected_attention"](stats=str(tmp_path / "stats.safetensors"))
        method.prepare(model, None)
    inputs = {i: [] for i in layers}  # layer -> each decode step's attention input
    hooks = [model.model.layers[i].self_attn.register_forward_pre_hook(
        lambda m, a, kw, i=i: inputs[i].append(kw["hidden_states"]) if kw["hidden_states"].shape[1] == 1 else None,
        with_kwargs=True) for i in layers]

    def record(capture, method, view, n_keep, idx):
        i, seen = view.layer_idx, capture.cache.layers[view.layer_idx].seen_tokens
        stats = window_statistics(model, i, torch.cat(inputs[i][-WINDOW:], dim=1)) if source == "window" \
            else (t[i][None] for t in method.loaded)
        return *stats, view.keys.clone(), view.values.clone(), seen, n_keep, idx, method.scores(view)

    try:
        calls = decoding_selections(model, method, prompt(N_PROMPT), BUDGET, NEW, DecodeCompression(EVERY, TARGET),
                                    record)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(calls) == 3 * len(layers)  # decode steps 16, 24 and 32 (a layer of 40 > 32)
    for mu, cov, keys, values, seen, n_keep, idx, ours in calls:
        assert seen > keys.shape[2] + BUDGET  # the layer holds far fewer entries than the tokens seen
        scores = reference_scores(model, mu, cov, keys, values, seen)
        torch.testing.assert_close(ours.double(), scores, rtol=1e-4, atol=1e-7)
        chosen = scores.gather(-1, idx).sort(-1).values
        best = scores.topk(n_keep, dim=-1).values.sort(-1).values
        torch.testing.assert_close(chosen, best, rtol=1e-5, atol=1e-9)
