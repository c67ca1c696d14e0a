"""TailorKV with tokens fed on top of its stores (query=agnostic's question, a conversation's later turns).

Independent expectations: transformers' own greedy `generate` over the whole prompt (a covering budget and layers
that keep everything in full precision must change nothing), the full cache's run of the same split (the chunk
attends every offloaded prompt row, so with no quantized layer its logits are the full cache's at any budget), the
same tokens appended one per step (the storage a decode would leave; for an offloaded layer at a covering budget also
the same attention), an eager float64 causal attention written here, and the ledger's bytes counted by hand."""
from __future__ import annotations

import copy

import pytest
import torch
from hydra import compose, initialize_config_dir

import kvbench.methods  # noqa: F401
from kvbench.attention.decode import attend, chunk_attention
from kvbench.cache.kv_cache import KVLayer
from kvbench.cache.ledger import TransferLedger
from kvbench.cache.offloaded import OffloadedLayer
from kvbench.cache.quantized import QuantizedLayer
from kvbench.engine.batching import generate
from kvbench.engine.generation import prepare
from kvbench.engine.turns import converse
from kvbench.methods.tailorkv import TailorKV
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from kvbench.runs.config import CONFIG_DIR, setup
from tests.unit.test_turns import NEW, greedy, kvbench_run
from tests.unit.tiny import prompt, tiny_model

N, Q = 100, 10  # prompt tokens, of which the last Q are the question
H_Q, H_KV, D, FP32 = 6, 2, 16, 4  # the tiny models' heads, fp32 entries
SMALL = {"start_size": 4, "recent_size": 4, "channels": 4}  # budget 24: 16 fetched of 86 candidates


def tailorkv(**kwargs) -> TailorKV:
    return TailorKV(**{**SMALL, **kwargs})


def test_agnostic_at_a_covering_budget_is_greedy_decoding_and_the_question_attends_everything():
    """Layer 0 quantized with a residual window longer than the whole run (it stays full precision), layers 1-2
    offloaded fetching every candidate: transformers' greedy. At a small budget with no quantized layer, the fed
    question still attends every prompt row: the full cache's logits, and the feed copied each offloaded layer's
    whole K and V (by hand)."""
    model, ids = tiny_model("llama", layers=3), prompt(N)
    eos = {model.generation_config.eos_token_id}
    with AttentionCapture(model) as capture:
        exact = generate(model, None, tailorkv(quant_layers=[0], residual=128, channels=D), capture, ids, N, NEW,
                         eos_ids=eos, question_len=Q)
        full_run = prepare(model, METHODS["full"](), capture, ids, None, NEW, question_len=Q)
        small_run = prepare(model, tailorkv(quant_layers=[]), capture, ids, 24, NEW, question_len=Q)
    assert exact.token_ids == greedy(model, ids[0].tolist()) and exact.token_ids
    assert exact.timings["question_s"] > 0
    row = H_KV * D * FP32  # one token's K (or V) in one layer
    assert exact.transfers["feed_bytes"] == {"offloaded_keys": 2 * (N - Q) * row, "offloaded_values": 2 * (N - Q) * row}
    assert small_run.ledger.summary()["feed_bytes"] == {"offloaded_keys": 3 * (N - Q) * row,
                                                        "offloaded_values": 3 * (N - Q) * row}
    assert not small_run.ledger.steps  # the feed is no decode step
    torch.testing.assert_close(small_run.logits, full_run.logits, rtol=1e-5, atol=1e-5)
    assert small_run.kept_per_head[-1][0] == 24 + Q  # the decode steps do retrieve: sinks + recent + top-k + fed


def filled_layer(n: int, seed: int = 0) -> KVLayer:
    g = torch.Generator().manual_seed(seed)
    layer = KVLayer()
    layer.update(torch.randn(1, H_KV, n, D, generator=g), torch.randn(1, H_KV, n, D, generator=g))
    return layer


def chunk(q: int, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, H_KV, q, D, generator=g), torch.randn(1, H_KV, q, D, generator=g),
            torch.randn(1, H_Q, q, D, generator=g))


def eager_causal(query, keys, values, scaling):
    """float64, query head by query head: row i sees every entry but the chunk's rows after it (the chunk is last)."""
    q_len, length = query.shape[2], keys.shape[2]
    out = torch.empty(1, q_len, H_Q, D, dtype=torch.float64)
    for h in range(H_Q):
        k, v = keys[0, h // (H_Q // H_KV)].double(), values[0, h // (H_Q // H_KV)].double()
        for i in range(q_len):
            seen = length - q_len + i + 1
            p = torch.softmax(query[0, h, i].double() @ k[:seen].T * scaling, -1)
            out[0, i, h] = p @ v[:seen]
    return out


@pytest.mark.parametrize("q", [3, 4, 37])  # the key residual (12) stays below a block / fills one / three fill
def test_quantized_chunk_stores_as_one_token_per_step_and_attends_the_past_plus_itself_unquantized(q):
    layer = QuantizedLayer.from_layer(filled_layer(44), bits=2, group=8, residual=16)  # keys 32 + 12, values 28 + 16
    past = layer.decode_kv()  # what a step before the chunk attends: the past dequantized / residual
    steps = copy.deepcopy(layer)
    keys, values, query = chunk(q)
    layer.update(keys, values)
    for t in range(q):
        steps.update(keys[:, :, t:t + 1], values[:, :, t:t + 1])
    n = 44 + q
    assert layer.k_quant.length == steps.k_quant.length == n - ((n - 1) % 16 + 1)  # a block just filled stays fp
    assert layer.v_quant.packed.shape[-2] == n - 17 and layer.get_seq_length() == n == layer.seen_tokens
    for name in ("packed", "scale", "zero"):  # bitwise the storage of q decode steps
        assert torch.equal(getattr(layer.k_quant, name), getattr(steps.k_quant, name))
        assert torch.equal(getattr(layer.v_quant, name), getattr(steps.v_quant, name))
    assert torch.equal(layer.keys, steps.keys) and torch.equal(layer.values, steps.values)
    seen = layer.decode_kv(query)
    assert torch.equal(seen.keys, torch.cat([past.keys, keys], dim=2))
    assert torch.equal(seen.values, torch.cat([past.values, values], dim=2))
    out = chunk_attention(query, seen, 0.25)
    torch.testing.assert_close(out.double(), eager_causal(query, seen.keys, seen.values, 0.25), rtol=1e-5, atol=1e-5)
    # afterwards a decode step reads the stores as a decoded conversation's: equal to the stepped layer's
    assert torch.equal(layer.decode_kv().keys, steps.decode_kv().keys)


def offloaded(n_topk: int, channels: int) -> OffloadedLayer:
    layer = OffloadedLayer.from_layer(filled_layer(60), 4, 6, n_topk, channels, TransferLedger())
    layer.selections = []
    return layer


@pytest.mark.parametrize("q", [1, 9])
def test_offloaded_chunk_equals_one_token_per_step_at_a_covering_budget(q):
    """Every candidate fetched: a decode step attends sinks + recent + all 50 candidates + generated, everything,
    so the chunk's dense attention must give each row what the same tokens decoded one per step give."""
    chunked, stepped = offloaded(50, D), offloaded(50, D)
    keys, values, query = chunk(q)
    chunked.update(keys, values)
    if q > 1:
        out = chunk_attention(query, chunked.decode_kv(query), 0.25)
        assert chunked.ledger.feed == {"offloaded_keys": 60 * H_KV * D * FP32, "offloaded_values": 60 * H_KV * D * FP32}
        assert not chunked.ledger.steps and not chunked.selections
    rows = []
    for t in range(q):
        stepped.update(keys[:, :, t:t + 1], values[:, :, t:t + 1])
        rows.append(attend(stepped, query[:, :, t:t + 1], 0.25))
    if q > 1:
        torch.testing.assert_close(out, torch.cat(rows, dim=1), rtol=1e-5, atol=1e-5)
    # the fed tokens joined the generated ones on the device: never candidates, always attended
    for name in ("keys", "values", "positions"):
        assert torch.equal(getattr(chunked, name), getattr(stepped, name))
    assert chunked.positions[0, 0].tolist() == list(range(60, 60 + q)) and chunked.get_seq_length() == 60 + q


def test_offloaded_decode_after_a_chunk_retrieves_from_the_prompt_only():
    """At a small budget the step after a chunk picks its top-k among the prompt's candidates and attends the chunk
    whole, as after the same tokens decoded one per step (same storage, same selection, same output)."""
    chunked, stepped = offloaded(8, 4), offloaded(8, 4)
    keys, values, query = chunk(9)
    chunked.update(keys, values)
    chunked.decode_kv(query)
    for t in range(9):
        stepped.update(keys[:, :, t:t + 1], values[:, :, t:t + 1])
        attend(stepped, query[:, :, t:t + 1], 0.25)
    new_k, new_v, new_q = chunk(1, seed=8)
    outs = []
    for layer in (chunked, stepped):
        layer.update(new_k, new_v)
        outs.append(attend(layer, new_q, 0.25))
    (channels, top), last = chunked.selections[-1], stepped.selections[-1]
    assert torch.equal(channels, last[0]) and torch.equal(top, last[1])
    assert top.min() >= 4 and top.max() < 60 - 6 and top.shape[-1] == 8
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert chunked.entries_per_head() == [10 + 8 + 10] * H_KV  # sinks + recent, top-k, 9 fed + 1 generated


def test_conversations_at_a_covering_budget_equal_the_full_cache_and_reset_repeats_itself():
    model = tiny_model("llama", layers=3)
    first, followups = prompt(90)[0].tolist(), [prompt(7, seed=s)[0].tolist() for s in (3, 4)]
    covering = tailorkv(quant_layers=[0], residual=128, channels=D)
    with AttentionCapture(model) as capture:
        full = list(converse(model, None, METHODS["full"](), capture, torch.tensor([first]), followups, None, NEW))
        ours = list(converse(model, None, covering, capture, torch.tensor([first]), followups, 90, NEW))
        question = prompt(6, seed=8)[0].tolist()
        reset = list(converse(model, None, tailorkv(quant_layers=[0], residual=16, group_size=16), capture,
                              torch.tensor([first + question]), [question, question], 24, NEW, mode="reset",
                              question_len=6))
    assert [g.token_ids for g in ours] == [g.token_ids for g in full] and all(g.token_ids for g in ours)
    for gen in ours[1:]:  # each turn's ledger: its own decode steps (one per fed token), its own feed
        assert len(gen.transfers["h2d_bytes_per_step"]["topk_keys"]) == len(gen.token_ids) - 1
        assert gen.transfers["feed_bytes"]["offloaded_keys"] == 2 * 90 * H_KV * D * FP32
    # reset: every turn decodes on a copy of the compressed context (its prefetch hook on the copy's layers)
    assert reset[0].token_ids == reset[1].token_ids == reset[2].token_ids
    assert reset[0].transfers == reset[2].transfers and reset[2].transfers["h2d_bytes_per_step"]["critical_keys"]


def test_tailorkv_is_accepted_with_feeds():
    def check(*overrides):
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            setup(compose("config", overrides=["model=tiny_llama", *overrides]))

    assert TailorKV.takes_chunks
    check("query=agnostic", "method=tailorkv", "budget=256")
    check("dataset=niah_multiturn", "dataset.turns=2", "method=tailorkv", "budget=256")


@pytest.mark.parametrize("mode", ["append", "reset"])
def test_niah_multiturn_runs_with_tailorkv(tmp_path, mode):
    _, recs = kvbench_run(tmp_path, "method=tailorkv", "budget=32", "method.start_size=4", "method.recent_size=4",
                          "method.quant_layers=[0]", "method.residual=64", "dataset.turns=2",
                          f"dataset.turn_mode={mode}", "query=agnostic")
    assert [r["turn"] for r in recs] == [0, 1, 0, 1] and all("error" not in r for r in recs)
    assert all(r["transfers"]["feed_bytes"]["offloaded_keys"] > 0 for r in recs)
    if mode == "append":  # the answer and the follow-up join the device-resident stores
        assert recs[1]["kv_bytes"] > recs[0]["kv_bytes"]


def test_scbench_runs_with_tailorkv(tmp_path):
    from tests.unit.test_cli import records, run_here
    from tests.unit.test_scbench import FIXTURES

    scb = records(run_here("model=tiny_llama", "method=tailorkv", "budget=32", "method.start_size=4",
                           "method.recent_size=4", "method.quant_layers=[0]", "method.residual=64", "dataset=scbench",
                           f"dataset.root={FIXTURES}", "dataset.tasks=[scbench_kv]", "dataset.limit_per_task=1",
                           "dataset.max_turns=2", "dataset.max_new_tokens=3", "dataset.turn_mode=append",
                           results=tmp_path / "scb"))
    assert [r["id"] for r in scb] == ["scbench_kv-0-t0", "scbench_kv-0-t1"] and all("error" not in r for r in scb)
    assert scb[1]["kv_bytes"] > scb[0]["kv_bytes"] and scb[1]["transfers"]["feed_bytes"]["offloaded_values"] > 0
