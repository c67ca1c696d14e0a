"""Beam search over the compressed cache (kvbench.engine.beam): one beam is greedy; two beams with the full cache are
transformers' own beam search; with an evicting method every beam keeps its own (reordered) cache and scores."""
from __future__ import annotations

import pytest
import torch

import kvbench.methods  # noqa: F401
from kvbench.engine.beam import beam_generate
from kvbench.engine.batching import generate
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from tests.unit.tiny import prompt, tiny_model

N, NEW = 40, 10


@pytest.mark.parametrize("name,budget", [("full", None), ("h2o", 16), ("snapkv", 24)])
def test_one_beam_is_greedy(name, budget):
    model, ids = tiny_model(), prompt(N)
    method = METHODS[name](**({"window": 8} if name == "snapkv" else {}))
    with AttentionCapture(model, window=getattr(method, "window", 0)) as capture:
        greedy = generate(model, None, method, capture, ids, budget, NEW, eos_ids=set())
        beam = beam_generate(model, None, method, capture, ids, budget, NEW, 1, eos_ids=set())
    assert beam.token_ids == greedy.token_ids and len(beam.token_ids) == NEW


def hf_beams(model, ids, eos, num_beams, early_stopping):
    out = model.generate(ids, max_new_tokens=NEW, num_beams=num_beams, do_sample=False, eos_token_id=eos,
                         pad_token_id=eos, early_stopping=early_stopping, length_penalty=1.0)[0, N:].tolist()
    return [t for t in out if t != eos]


@pytest.mark.parametrize("num_beams,early_stopping", [(2, False), (2, True), (4, True)])
def test_beams_full_cache_equal_transformers(num_beams, early_stopping):
    model, ids = tiny_model(), prompt(N)
    greedy = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=2)[0, N:].tolist()
    plain = hf_beams(model, ids, 2, num_beams, early_stopping)
    assert plain != greedy  # the search really differs from greedy on this prompt
    # make a token the beams produce an EOS, so hypotheses finish mid-way and the bookkeeping is exercised
    for eos in [2, plain[NEW // 2]]:
        expected = hf_beams(model, ids, eos, num_beams, early_stopping)
        with AttentionCapture(model) as capture:
            got = beam_generate(model, None, METHODS["full"](), capture, ids, None, NEW, num_beams, eos_ids={eos},
                                early_stopping=early_stopping)
        assert got.token_ids == expected


def test_beams_keep_their_own_cache_and_scores():
    """H2O with 3 beams: each beam row scores its own token, evicts within budget, and `reorder` gathers cache rows
    (keys, values, positions) and score rows with the same indices."""
    from kvbench.engine.beam import reorder
    from kvbench.cache import KVCache

    model, ids = tiny_model(), prompt(N)
    method = METHODS["h2o"]()
    state = method.start(N, 16, NEW, 0)
    cache = KVCache()
    with AttentionCapture(model) as capture:
        capture.column_score = lambda logits: method.row_score(logits, state, decoding=False)
        from kvbench.engine.generation import compress, prefill

        prefill(model, ids, cache)
        compress(method, cache, capture, 16, state)
        reorder(cache, torch.zeros(3, dtype=torch.long), state)
        tokens = torch.tensor([[5], [6], [7]])
        model(input_ids=tokens, past_key_values=cache, position_ids=torch.full((3, 1), N), use_cache=True)
        assert all(layer.keys.shape[:3] == (3, 2, 16) for layer in cache.layers)
        s = state.scores[0]
        assert not torch.equal(s[0], s[1]) and not torch.equal(s[1], s[2])  # each beam scored its own token
        order = torch.tensor([2, 2, 0])
        before = [layer.positions.clone() for layer in cache.layers], state.scores[1].clone()
        reorder(cache, order, state)
        assert torch.equal(cache.layers[1].positions, before[0][1][order])
        assert torch.equal(state.scores[1], before[1][order])


def test_beams_with_decode_time_eviction_and_shifted_positions():
    model, ids = tiny_model(), prompt(N)
    with AttentionCapture(model) as capture:
        gen = beam_generate(model, None, METHODS["buzz"](), capture, ids, 24, NEW, 3, eos_ids=set(),
                            positions="shift")
    assert len(gen.token_ids) == NEW and gen.timings["num_beams"] == 3 and gen.kv_bytes < gen.full_kv_bytes


def test_bad_beam_settings_are_one_line():
    from kvbench.engine.generation import Sampling

    with pytest.raises(ValueError, match="^generation: num_beams=0 must be >= 1"):
        Sampling(num_beams=0)
    with pytest.raises(ValueError, match="^generation: num_beams=2 is beam search, which is greedy here"):
        Sampling(num_beams=2, do_sample=True)
@pytest.mark.parametrize("name,budget,kw", [("streamingllm_rolling", 16, {}), ("buzz", 24, {"logn": True}),
                                            ("h2o", 16, {"variant": "kvcache_factory", "recent_size": 4})])
def test_one_beam_is_greedy_with_pos_shift_and_the_paper_variants(name, budget, kw):
    """positions=shift, BUZZ's log-n temperature and KVCache-Factory's H2O scores go through beam search too."""
    model, ids = tiny_model(), prompt(N)
    method = METHODS[name](**kw)
    with AttentionCapture(model) as capture:
        greedy = generate(model, None, method, capture, ids, budget, NEW, eos_ids=set(), positions="shift")
        beam = beam_generate(model, None, method, capture, ids, budget, NEW, 1, eos_ids=set(), positions="shift")
    assert beam.token_ids == greedy.token_ids and len(beam.token_ids) == NEW
