"""Decode-time eviction (H2O, Keyformer, BUZZ) against an independent step-by-step masked simulation.

The reference keeps the whole cache (transformers' DynamicCache), computes every layer's attention in full with
eager math, masks each KV head to its own kept set (Python lists), accumulates the method's row scores and applies
the method's rule, written again here from the spec. kvbench evicts physically; both must keep the same original
positions after prefill and after every decode step, well past the budget.
"""
from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

import kvbench.methods  # noqa: F401
from kvbench.engine.batching import generate
from kvbench.methods.buzz import theorem_ratio
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from tests.unit.tiny import attention_function, prompt, tiny_model

N, STEPS, BUDGET, MAX_NEW = 60, 30, 24, 40


# --- reference selection rules (plain Python over one head) -------------------------------------------------------
def heavy_recent(kept, score, k, w):
    if len(kept) <= k:
        return kept
    heavy = sorted(kept[: len(kept) - w], key=lambda p: -score[p])[: k - w]
    return sorted(heavy) + kept[len(kept) - w:]


def keyformer_frozen(kept, score, k, w, prefill):
    if len(kept) <= k:
        return kept
    if prefill:
        return sorted(sorted(kept[: len(kept) - w - 1], key=lambda p: -score[p])[: k - w]) + kept[-w:]
    return kept[: len(kept) - w - 1] + kept[-w:]


class BuzzRef:
    def __init__(self, sink, w, t, s, loop=True):
        self.sink, self.w, self.t, self.s, self.loop, self.m_old = sink, w, t, s, loop, 0

    def __call__(self, kept_heads, scores, prefill):
        n = len(kept_heads[0])
        if n - self.sink - self.w <= self.t:
            return kept_heads
        s_hat = (self.s + 1) // 2
        out = []
        for kept, score in zip(kept_heads, scores):
            middle = kept[self.sink: n - self.w]
            old = middle[: self.m_old][::s_hat]
            new = middle[self.m_old:]
            chunks = [new[i: i + self.s] for i in range(0, len(new), self.s)]
            best = [max(c, key=lambda p: (score[p], -p)) for c in chunks]  # first maximum on ties
            mid = old + best
            while prefill and self.loop and len(mid) > self.t:
                mid = mid[::s_hat]
            out.append(kept[: self.sink] + mid + kept[n - self.w:])
        self.m_old = len(out[0]) - self.sink - self.w
        return out


# --- the masked simulation ------------------------------------------------------------------------------------------
class Reference:
    """Per layer: kept positions per KV head, accumulated scores per (head, position)."""

    def __init__(self, model, rule, row_score, group_mean=True):
        self.model, self.rule, self.row_score = model, rule, row_score
        cfg = model.config
        self.h_q, self.h_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.kept, self.score, self.history = {}, {}, []

    def _reduce(self, rows):  # [H_q, T] -> [H_kv, T]
        return rows.view(self.h_kv, -1, rows.shape[-1]).mean(1)

    def prefill(self, ids):
        self.model.set_attn_implementation("eager")
        cache = DynamicCache()
        with torch.no_grad():
            out = self.model(ids, past_key_values=cache, output_attentions=True)
        self.model.set_attn_implementation("sdpa")
        for layer, attn in enumerate(out.attentions):  # [1, H_q, n, n]: full matrices
            rows = self.row_score(attn[0].double().log(), step=0)  # log p = masked logits - row constant
            col = self._reduce(rows.sum(1))
            n = col.shape[-1]
            self.score[layer] = [dict(enumerate(col[h].tolist())) for h in range(self.h_kv)]
            self.kept[layer] = self.rule(layer, [list(range(n))] * self.h_kv, self.score[layer], True)
        self.history.append(self.snapshot())
        return cache

    def step(self, cache, token, pos, step):
        ref = self

        def masked(module, q, k, v, mask, scaling=None, **kw):
            layer = module.layer_idx
            t = k.shape[2]
            for h in range(ref.h_kv):
                ref.kept[layer][h] = ref.kept[layer][h] + [t - 1]  # the new token enters every head's cache
            allowed = torch.zeros(ref.h_kv, t, dtype=torch.bool)
            for h, kept in enumerate(ref.kept[layer]):
                allowed[h, kept] = True
            allowed = allowed.repeat_interleave(ref.h_q // ref.h_kv, 0)
            kr = k.repeat_interleave(ref.h_q // ref.h_kv, 1)
            vr = v.repeat_interleave(ref.h_q // ref.h_kv, 1)
            logits = (q.double() @ kr.double().transpose(-1, -2))[0, :, 0] * scaling  # [H_q, t]
            logits = logits.masked_fill(~allowed, float("-inf"))
            probs = logits.softmax(-1)
            out = (probs[:, None, :] @ vr[0].double())[:, 0]  # [H_q, D]
            # row scores over the kept entries only (in kept order, as the physical cache holds them)
            per_head = []
            for hq in range(ref.h_q):
                kept = ref.kept[layer][hq * ref.h_kv // ref.h_q]
                per_head.append(ref.row_score(logits[hq, kept][None, None], step=step)[0, 0])
            rows = torch.stack(per_head).view(ref.h_kv, -1, len(per_head[0])).mean(1)
            for h in range(ref.h_kv):
                for p, r in zip(ref.kept[layer][h], rows[h].tolist()):
                    ref.score[layer][h][p] = ref.score[layer][h].get(p, 0.0) + r
            ref.kept[layer] = ref.rule(layer, ref.kept[layer], ref.score[layer], False)
            return out[None, None].to(q.dtype), None

        with attention_function(self.model, masked):
            self.model(token, past_key_values=cache, position_ids=torch.tensor([[pos]]))
        self.history.append(self.snapshot())

    def snapshot(self):
        return [[list(k) for k in self.kept[layer]] for layer in sorted(self.kept)]


def ours(model, name, kw, ids, seed=0):
    method = METHODS[name](**kw)
    history = []

    def snap(t, logits):
        layers = capture.cache.layers
        history.append([[row.tolist() for row in layer.positions[0]] for layer in layers])

    with AttentionCapture(model) as capture:
        gen = generate(model, None, method, capture, ids, BUDGET, STEPS, eos_ids=set(), on_logits=snap, seed=seed)
    return gen, history


def run_reference(model, ids, tokens, rule, row_score):
    ref = Reference(model, rule, row_score)
    cache = ref.prefill(ids)
    for t, token in enumerate(tokens[:-1]):
        ref.step(cache, torch.tensor([[token]]), N + t, step=t + 1)
    return ref.history


def softmax_rows(logits, step):
    return logits.softmax(-1)


def gumbel_rows(generator, tau_init=1.0, tau_end=2.0, n_new=STEPS):
    def rows(logits, step):
        exp = torch.empty(logits.shape, dtype=torch.float32).exponential_(generator=generator)
        tau = tau_init + step * (tau_end - tau_init) / n_new
        return ((logits - exp.log().double()) / tau).softmax(-1)
    return rows


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_h2o_matches_masked_simulation_every_step(family):
    model, ids = tiny_model(family, layers=2), prompt(N)
    gen, history = ours(model, "h2o", {}, ids)
    rule = lambda layer, heads, scores, prefill: [heavy_recent(k, s, BUDGET, BUDGET // 2)  # noqa: E731
                                                  for k, s in zip(heads, scores)]
    assert history == run_reference(model, ids, gen.token_ids, rule, softmax_rows)
    assert max(len(row) for step in history for layer in step for row in layer) == BUDGET


@pytest.mark.parametrize("selection", ["paper", "code_frozen"])
def test_keyformer_matches_masked_simulation_every_step(selection):
    model, ids = tiny_model("llama", layers=2), prompt(N)
    gen, history = ours(model, "keyformer", {"selection": selection}, ids, seed=7)
    w = int(BUDGET * 0.3)
    if selection == "paper":
        rule = lambda layer, heads, scores, prefill: [heavy_recent(k, s, BUDGET, w)  # noqa: E731
                                                      for k, s in zip(heads, scores)]
    else:
        rule = lambda layer, heads, scores, prefill: [keyformer_frozen(k, s, BUDGET, w, prefill)  # noqa: E731
                                                      for k, s in zip(heads, scores)]
    # same seeded noise stream, drawn in the same order (prefill per layer, then per step per layer)
    noise = gumbel_rows(torch.Generator().manual_seed(7))
    assert history == run_reference(model, ids, gen.token_ids, rule, noise)


def test_buzz_matches_masked_simulation_every_step():
    model, ids = tiny_model("mistral", layers=2), prompt(N)
    gen, history = ours(model, "buzz", {"stride": 3}, ids)
    w = round((BUDGET - 4) / (1 + theorem_ratio(3)))
    refs = {}

    def rule(layer, heads, scores, prefill):
        refs.setdefault(layer, BuzzRef(4, w, BUDGET - 4 - w, 3))
        return refs[layer](heads, scores, prefill)

    assert history == run_reference(model, ids, gen.token_ids, rule, softmax_rows)
    assert max(len(row) for step in history for layer in step for row in layer) <= BUDGET


# --- TOVA: the current query's attention, not accumulated ---------------------------------------------------------
def tova_rows(logits, step):
    """Softmax rows; at prefill only the prompt's last query row (TOVA scores with `attn_weights[:, :, -1, :]`)."""
    probs = logits.softmax(-1)
    if step == 0:
        probs = probs.clone()
        probs[..., :-1, :] = 0
    return probs


@pytest.mark.parametrize("selection", ["layer", "kv_head"])
def test_tova_matches_masked_simulation_every_step(selection):
    """Each step keeps the `budget` entries with the highest attention from the current query: averaged over all
    query heads, one set per layer (the reference code), or per KV head. The Reference accumulates row scores, so
    the rule clears them after use: each step sees only its own row."""
    model, ids = tiny_model("llama", layers=2), prompt(N)
    gen, history = ours(model, "tova", {"selection": selection}, ids)

    def rule(layer, heads, scores, prefill):
        if len(heads[0]) > BUDGET:
            if selection == "layer":
                mean = {p: sum(s[p] for s in scores) / len(scores) for p in heads[0]}
                kept = sorted(sorted(heads[0], key=lambda p: -mean[p])[:BUDGET])
                heads = [kept] * len(heads)
            else:
                heads = [sorted(sorted(k, key=lambda p: -s[p])[:BUDGET]) for k, s in zip(heads, scores)]
        for s in scores:
            s.clear()
        return heads

    assert history == run_reference(model, ids, gen.token_ids, rule, tova_rows)
    assert max(len(row) for step in history for layer in step for row in layer) == BUDGET
    if selection == "layer":
        assert all(row == layer[0] for step in history for layer in step for row in layer)



def test_tova_prefill_only_selects_once_and_keeps_what_decoding_adds():
    """`prefill_only=true keep_last=true` (kvpress's TOVAPress): the prompt's selection is the one TOVA makes (the
    last query's row, the last entry kept), and after it nothing is evicted: each step's entry stays."""
    model, ids = tiny_model("llama", layers=2), prompt(N)
    _, every = ours(model, "tova", {"keep_last": True}, ids)
    _, once = ours(model, "tova", {"keep_last": True, "prefill_only": True}, ids)
    assert once[0] == every[0]  # the same prompt selection (the first snapshot: after prefill, first token)
    assert all(row[-1] == N - 1 for layer in once[0] for row in layer)  # the last prompt entry kept
    for t, step in enumerate(once):  # the selection stays, every decoded token's entry added
        assert all(row == once[0][i][h] + list(range(N, N + t)) for i, layer in enumerate(step)
                   for h, row in enumerate(layer))

# --- Keyformer, shared score function (Table 3 row; the spec's reconstruction) -----------------------------------
@pytest.mark.parametrize("selection", ["paper", "code_frozen"])
def test_keyformer_shared_score_matches_masked_simulation(selection):
    """One accumulator summed over all layers (head index aligned); the rule runs once the last layer has scored
    (after prefill, and at each step after the last layer's attention) and every layer keeps the same entries."""
    model, ids = tiny_model("llama", layers=3), prompt(N)
    gen, history = ours(model, "keyformer", {"selection": selection, "score": "shared"}, ids, seed=3)
    w, last = int(BUDGET * 0.3), model.config.num_hidden_layers - 1
    ref = Reference(model, None, gumbel_rows(torch.Generator().manual_seed(3)))
    keep = heavy_recent if selection == "paper" else None

    def rule(layer, heads, scores, prefill):
        if layer != last:
            return heads  # grows until the last layer has scored this step
        total = [{p: sum(ref.score[i][h][p] for i in range(last + 1)) for p in heads[h]} for h in range(len(heads))]
        if keep is not None:
            chosen = [keep(k, t, BUDGET, w) for k, t in zip(heads, total)]
        else:
            chosen = [keyformer_frozen(k, t, BUDGET, w, prefill) for k, t in zip(heads, total)]
        for i in range(last):
            ref.kept[i] = [list(c) for c in chosen]
        return chosen

    ref.rule = rule
    cache = ref.prefill(ids)
    for t, token in enumerate(gen.token_ids[:-1]):
        ref.step(cache, torch.tensor([[token]]), N + t, step=t + 1)
    assert history == ref.history
    assert all(layer == step[0] for step in history for layer in step)  # one selection shared by every layer
    assert max(len(row) for step in history for layer in step for row in layer) == BUDGET


# --- BUZZ eviction trace (seed-buzz.md §1.7) --------------------------------------------------------------------
def test_buzz_eviction_trace_from_the_spec():
    """k=4, w=160, T=400, s=5, a 1000-token prompt: evictions at decode steps 233, 531, 837 with the spec's
    (step, length at trigger, old, new, middle after) tuples."""
    method = METHODS["buzz"](window=160, threshold=400, prefill_mode="single_pass")
    state = method.start(1000, 564, 1000, seed=0)
    state.extra[0] = {}
    scores = torch.rand(1, 2, 1000)
    trace = []

    def evict(step, scores):
        n, m_old = scores.shape[-1], state.extra[0].get("m_old", 0)
        idx = method.evict(state, 0, scores, prefill=step == "prefill")
        if idx is not None:
            trace.append((step, n, m_old, n - 4 - 160 - m_old, state.extra[0]["m_old"]))
            scores = scores.gather(-1, idx)
        return scores

    scores = evict("prefill", scores)
    for step in range(1, 900):
        scores = evict(step, torch.cat([scores, torch.rand(1, 2, 1)], dim=-1))
    assert trace == [("prefill", 1000, 0, 836, 168), (233, 565, 168, 233, 103), (531, 565, 103, 298, 95),
                     (837, 565, 95, 306, 94)]


def test_buzz_budget_mapping_follows_theorem_3_1():
    for budget, window, threshold in [(64, 11, 49), (128, 23, 101), (256, 47, 205), (1024, 191, 829)]:
        assert METHODS["buzz"]().sizes(budget) == (window, threshold)  # the spec's §2.2 table
    assert math.isclose(theorem_ratio(5), 13 / 3) and theorem_ratio(4) == 3


# --- Keyformer: paper vs code_frozen on hand-made scores ------------------------------------------------------------
def keyformer_keep(selection, scores, prefill):
    method = METHODS["keyformer"](selection=selection, recent_ratio=0.34)  # k=6 -> w=2, 4 key tokens
    state = method.start(10, 6, 10, seed=0)
    state.extra[0] = {"key_set_chosen": True}  # decode steps here follow a prefill that chose the key set
    idx = method.evict(state, 0, torch.tensor([[scores]]), prefill=prefill)
    return idx[0, 0].tolist()


def test_keyformer_rules_differ_only_on_the_boundary_token():
    # prefill, n=10, k=6, w=2: the boundary token is position 7 (n - w - 1)
    boundary_high = [5, 1, 4, 2, 3, 0, 0.5, 9, 0, 0]
    assert keyformer_keep("paper", boundary_high, True) == [0, 2, 4, 7, 8, 9]  # 7 competes and wins
    assert keyformer_keep("code_frozen", boundary_high, True) == [0, 2, 3, 4, 8, 9]  # 7 is dropped unscored
    boundary_low = [5, 1, 4, 2, 3, 0, 0.5, -1, 0, 0]
    assert keyformer_keep("paper", boundary_low, True) == keyformer_keep("code_frozen", boundary_low, True)
    # decode, 7 entries after the append: the entry that just left the window is index 4
    step_high = [1, 2, 3, 4, 9, 0, 0]
    assert keyformer_keep("paper", step_high, False) == [1, 2, 3, 4, 5, 6]  # evicts the weakest key (index 0)
    assert keyformer_keep("code_frozen", step_high, False) == [0, 1, 2, 3, 5, 6]  # always the boundary
    step_low = [1, 2, 3, 4, -9, 0, 0]
    assert keyformer_keep("paper", step_low, False) == keyformer_keep("code_frozen", step_low, False)


def test_seeded_keyformer_reruns_are_identical():
    model, ids = tiny_model("llama", layers=2), prompt(N)
    (a, ha), (b, hb), (c, hc) = (ours(model, "keyformer", {}, ids, seed=s) for s in (3, 3, 4))
    assert ha == hb and a.token_ids == b.token_ids
    assert ha != hc  # the noise matters


@pytest.mark.parametrize("name", ["h2o", "keyformer", "buzz"])
def test_budget_at_or_above_everything_equals_full(name):
    model, ids = tiny_model("llama", layers=2), prompt(N)
    method, full = METHODS[name](), METHODS["full"]()
    with AttentionCapture(model) as capture:
        a = generate(model, None, full, capture, ids, None, 10, eos_ids=set())
        b = generate(model, None, method, capture, ids, N + 20, 10, eos_ids=set())
    assert a.token_ids == b.token_ids and b.kv_bytes_final == a.kv_bytes_final


def test_keyformer_shared_score_under_beam_search(monkeypatch):
    """Table 3 runs 4 beams: with the shared score every beam row keeps the same entries in every layer, within the
    budget, each time the beams are reordered."""
    from kvbench.engine import beam

    seen, reorder = [], beam.reorder

    def spy(cache, beam_idx, state):
        reorder(cache, beam_idx, state)
        seen.append([layer.positions.clone() for layer in cache.layers])

    monkeypatch.setattr(beam, "reorder", spy)
    model, ids = tiny_model("llama", layers=3), prompt(N)
    with AttentionCapture(model) as capture:
        gen = beam.beam_generate(model, None, METHODS["keyformer"](score="shared"), capture, ids, BUDGET, 8, 3,
                                 eos_ids=set(), seed=1)
    assert len(gen.token_ids) == 8 and len(seen) >= 8
    for layers in seen:
        assert layers[0].shape[:2] == (3, 2) and layers[0].shape[-1] <= BUDGET
        assert all(torch.equal(layer, layers[0]) for layer in layers)
