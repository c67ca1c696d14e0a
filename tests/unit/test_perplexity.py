"""Perplexity under a compressed cache (kvbench.engine.perplexity), checked against independent computations: the full
cache equals one causal forward; an evicting method's stream equals greedy generation through the same method
(same tokens fed -> same caches -> same logits), so eviction during the stream is generation's own."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import kvbench.methods  # noqa: F401
from kvbench.engine.batching import generate, teacher_force
from kvbench.engine.generation import prepare
from kvbench.models import AttentionCapture
from kvbench.engine.perplexity import stream_nll, window_nll
from kvbench.registry import METHODS
from tests.unit.tiny import prompt, tiny_model


def forward_nll(model, fed: list[int], labels: list[int | None]) -> tuple[float, int]:
    with torch.no_grad():
        logits = model(torch.tensor([fed])).logits[0].float()
    pairs = [(i, y) for i, y in enumerate(labels) if y is not None]
    nll = F.cross_entropy(logits[[i for i, _ in pairs]], torch.tensor([y for _, y in pairs]), reduction="sum")
    return nll.item(), len(pairs)


def test_full_stream_is_one_causal_forward_over_the_fed_tokens():
    model = tiny_model()
    rows = [prompt(7, 1)[0].tolist(), [], [9], prompt(12, 2)[0].tolist()]  # empty and 1-token rows: no pair
    fed = [row[i] for row in rows for i in range(len(row) - 1)]
    labels = [row[i + 1] for row in rows for i in range(len(row) - 1)]
    expected, n = forward_nll(model, fed, labels)
    with AttentionCapture(model) as capture:
        got = stream_nll(model, METHODS["full"](), capture, rows, None)
    assert got.n_tokens == n == 6 + 11 and got.nll_sum == pytest.approx(expected, rel=1e-5)
    assert got.kv_bytes == got.full_kv_bytes  # nothing evicted


def test_full_stream_logits_equal_one_teacher_forced_forward():
    """A forced-token sequence through the engine's step, full cache: every step's logits are those of one forward
    over the whole text."""
    model, ids = tiny_model(), prompt(24, 4)[0].tolist()
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].float()
    seen = []
    with AttentionCapture(model) as capture:
        prep = prepare(model, METHODS["full"](), capture, torch.tensor([ids[:1]]), None, len(ids), "original", 0)
        teacher_force(model, capture, prep, ids[1:], lambda t, logits: seen.append(logits[0].float().clone()))
    got = torch.stack(seen)
    assert got.shape == want.shape and (got - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", ["h2o", "buzz"])
def test_stream_evicts_exactly_as_generation(name):
    """Greedy generation from a 2-token prompt, then the stream over [prompt, generated tokens]: each streamed
    NLL is -log p(argmax) of the logits generation saw at that step."""
    model, budget, new = tiny_model(), 12, 30
    ids = prompt(2, 3)
    seen = []
    method = METHODS[name]()
    with AttentionCapture(model) as capture:
        gen = generate(model, None, method, capture, ids, budget, new, eos_ids=set(),
                       on_logits=lambda t, logits: seen.append(logits.clone()))
        row = ids[0].tolist() + gen.token_ids
        got = stream_nll(model, method, capture, [row], budget)
    tokens = torch.tensor(gen.token_ids)
    logp = torch.cat(seen).float().log_softmax(-1)[torch.arange(new), tokens]
    # the stream also scores token 1 from token 0, which generation did not
    with torch.no_grad():
        first = F.cross_entropy(model(ids[:, :1]).logits[0, -1:].float(), ids[0, 1:2]).item()
    assert got.n_tokens == new + 1
    assert got.nll_sum == pytest.approx(first - logp.sum().item(), rel=1e-4)
    assert got.evicts and max(got.kept_per_layer) <= budget and got.kv_bytes < got.full_kv_bytes / 2


def test_prefill_only_method_does_not_evict_in_a_stream():
    model = tiny_model()
    with AttentionCapture(model, window=8) as capture:
        got = stream_nll(model, METHODS["snapkv"](window=8), capture, [prompt(20, 4)[0].tolist()], 16)
    assert not got.evicts and got.kv_bytes == got.full_kv_bytes


def test_chunked_window_full_cache_and_compressed():
    model, tokens = tiny_model(), prompt(48, 5)[0].tolist()
    expected, n = forward_nll(model, tokens[:-1], [None] * 31 + tokens[32:])
    with AttentionCapture(model) as capture:
        full = window_nll(model, METHODS["full"](), capture, tokens, 32, None)
    assert full.n_tokens == n == 16 and full.nll_sum == pytest.approx(expected, rel=1e-5)
    with AttentionCapture(model, window=8) as capture:
        snap = window_nll(model, METHODS["snapkv"](window=8), capture, tokens, 32, 16)
    assert snap.n_tokens == 16 and snap.nll_sum != pytest.approx(expected, rel=1e-6)
    assert snap.kept_per_layer == [16 + 15] * len(snap.kept_per_layer)  # budget + the 15 fed tokens


def test_keyformer_stream_evicts_with_its_noise_seeded():
    model, row = tiny_model(), prompt(30, 6)[0].tolist()
    with AttentionCapture(model) as capture:
        a = stream_nll(model, METHODS["keyformer"](), capture, [row], 12, seed=1)
        b = stream_nll(model, METHODS["keyformer"](), capture, [row], 12, seed=1)
    assert a.evicts and max(a.kept_per_layer) <= 12 and a.nll_sum == b.nll_sum and a.n_tokens == 29


def test_shifted_positions_stream_and_window_run():
    """positions=shift (BUZZ's pos-shift): the stream and a window go through generation.prepare's shift path."""
    model, row = tiny_model(), prompt(30, 7)[0].tolist()
    with AttentionCapture(model) as capture:
        a = stream_nll(model, METHODS["buzz"](), capture, [row], 16, positions="shift")
        b = window_nll(model, METHODS["h2o"](), capture, row, 20, 12, positions="shift")
    assert a.evicts and max(a.kept_per_layer) <= 16 and math.isfinite(a.nll_sum) and math.isfinite(b.nll_sum)
