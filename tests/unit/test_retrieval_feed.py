"""Quest and PQCache with tokens fed on top of their storage (query=agnostic's question, a conversation's turns).

Independent expectations: transformers' own greedy `generate` over the whole prompt (a budget covering everything
must change nothing), the full cache's run of the same split (a fed chunk attends the whole context densely, so its
logits are the full cache's whatever the budget), page bounds written out page by page, nearest centroids computed
here in float64, and the same tokens appended one per step (a chunk must leave the storage a decode would)."""
from __future__ import annotations

import copy

import pytest
import torch
from hydra import compose, initialize_config_dir

import kvbench.methods  # noqa: F401
from kvbench.cache.kv_cache import KVLayer
from kvbench.cache.ledger import TransferLedger
from kvbench.cache.pq_offloaded import MOVES, PQOffloadedLayer
from kvbench.engine.batching import generate
from kvbench.engine.generation import prepare
from kvbench.engine.turns import converse
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from kvbench.runs.config import CONFIG_DIR, setup
from tests.unit.test_turns import NEW, greedy, kvbench_run
from tests.unit.tiny import prompt, tiny_model

N, Q = 100, 10  # prompt tokens, of which the last Q are the question
SETTINGS = {"quest": ({"page_size": 16, "dense_layers": 0}, 128, 32),  # kwargs, budget covering all, small budget
            "pqcache": ({"sink_size": 4, "recent_size": 4, "bits": 4}, 128, 24)}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_agnostic_at_a_covering_budget_is_greedy_decoding_and_the_chunk_is_dense_at_any_budget(name):
    model, ids = tiny_model("llama", layers=3), prompt(N)
    kwargs, whole, small = SETTINGS[name]
    eos = {model.generation_config.eos_token_id}
    with AttentionCapture(model) as capture:
        full = generate(model, None, METHODS["full"](), capture, ids, None, NEW, eos_ids=eos, question_len=Q)
        exact = generate(model, None, METHODS[name](**kwargs), capture, ids, whole, NEW, eos_ids=eos, question_len=Q)
        full_run = prepare(model, METHODS["full"](), capture, ids, None, NEW, question_len=Q)
        small_run = prepare(model, METHODS[name](**kwargs), capture, ids, small, NEW, question_len=Q)
    assert exact.token_ids == full.token_ids == greedy(model, ids[0].tolist()) and exact.token_ids
    assert exact.timings["question_s"] > 0 and exact.transfers["feed_bytes"]
    # the question attended the whole context however small the budget: the full cache's next-token logits
    torch.testing.assert_close(small_run.logits, full_run.logits, rtol=1e-5, atol=1e-5)
    assert small_run.kept_per_head[-1][0] < N  # (and the budget does bind the decode steps)


def test_quest_pages_after_a_feed_are_the_pages_of_the_same_keys():
    """The fed question's keys join the pages (the context's last partial page first): the layer holds the full
    cache's keys, and its bounds are those of pages cut from scratch over them."""
    model, ids = tiny_model("llama", layers=3), prompt(N)
    page = 16
    with AttentionCapture(model) as capture:
        full = prepare(model, METHODS["full"](), capture, ids, None, NEW, question_len=Q).cache
        quest = prepare(model, METHODS["quest"](page_size=page, dense_layers=1), capture, ids, 32, NEW,
                        question_len=Q).cache
    for i, (dense, paged) in enumerate(zip(full.layers, quest.layers)):
        torch.testing.assert_close(paged.keys, dense.keys, rtol=1e-5, atol=1e-5)
        assert paged.keys.shape[-2] == N and paged.positions[0, 0].tolist() == list(range(N))
        if i == 0:  # a dense layer keeps no bounds
            assert paged.page_min is None
            continue
        assert paged.page_min.shape[2] == -(-N // page)
        for p in range(paged.page_min.shape[2]):  # N - Q = 90 = 5 pages + 10: the question filled page 5 first
            block = paged.keys[:, :, p * page:min((p + 1) * page, N)].double()
            assert torch.equal(paged.page_min[:, :, p].double(), block.amin(dim=2))
            assert torch.equal(paged.page_max[:, :, p].double(), block.amax(dim=2))


def pq_layer(n: int, seed: int = 0) -> PQOffloadedLayer:
    g = torch.Generator().manual_seed(seed)
    layer = KVLayer()
    layer.update(torch.randn(1, 2, n, 8, generator=g), torch.randn(1, 2, n, 8, generator=g))
    return PQOffloadedLayer.from_layer(layer, 3, 4, 5, 2, 3, 2, 0, TransferLedger(MOVES))


@pytest.mark.parametrize("q", [3, 12])  # shorter than the window, and longer (chunk tokens go straight to the host)
def test_pqcache_chunk_leaves_the_storage_of_one_token_per_step_with_nearest_centroid_codes(q):
    chunk_layer = pq_layer(30)
    step_layer = copy.deepcopy(chunk_layer)
    g = torch.Generator().manual_seed(7)
    keys, values = torch.randn(1, 2, q, 8, generator=g), torch.randn(1, 2, q, 8, generator=g)
    chunk_layer.update(keys, values)
    assert (chunk_layer.n_cand - 27 > 0) == (q == 12)
    for t in range(q):
        step_layer.update(keys[:, :, t:t + 1], values[:, :, t:t + 1])
    n = 30 + q
    assert chunk_layer.n_cand == step_layer.n_cand == n - 3 - 5  # the window keeps the last recent + 1 = 5
    assert torch.equal(chunk_layer.codes[..., :n - 3 - 5], step_layer.codes[..., :n - 3 - 5])
    for name in ("host_keys", "host_values"):
        assert torch.equal(getattr(chunk_layer, name)[:, :, :n - 8], getattr(step_layer, name)[:, :, :n - 8])
    for name in ("keys", "values", "positions"):
        assert torch.equal(getattr(chunk_layer, name), getattr(step_layer, name))
    # fed tokens that left the window carry their nearest prompt centroid, per partition (float64, by hand)
    first = 30 - 3  # codes start after the sinks; the prompt's window tokens got theirs from the K-means
    left = chunk_layer.n_cand - first  # fed tokens now among the candidates (q=12: 7; q=3: none)
    centroids = chunk_layer.centroids.double()  # [1, H, M, C, 4]
    for h in range(2):
        for t in range(left):
            for m in range(2):
                sub = keys[0, h, t, 4 * m:4 * (m + 1)].double()
                nearest = ((centroids[0, h, m] - sub) ** 2).sum(-1).argmin().item()
                assert chunk_layer.codes[0, h, m, first + t].item() == nearest
    # the chunk attends every entry, in position order, its own tokens last
    everything = chunk_layer.decode_kv(torch.zeros(1, 4, q, 8))
    assert everything.positions[0, 0].tolist() == list(range(n))
    assert torch.equal(everything.keys[:, :, -q:], keys)
    assert set(chunk_layer.ledger.feed) >= {"candidate_keys", "candidate_values"} and not chunk_layer.ledger.steps


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_append_conversation_at_a_covering_budget_equals_the_full_cache(name):
    model = tiny_model("llama", layers=3)
    first, followups = prompt(90)[0].tolist(), [prompt(7, seed=s)[0].tolist() for s in (3, 4)]
    kwargs, whole, _ = SETTINGS[name]
    with AttentionCapture(model) as capture:
        full = list(converse(model, None, METHODS["full"](), capture, torch.tensor([first]), followups, None, NEW))
        ours = list(converse(model, None, METHODS[name](**kwargs), capture, torch.tensor([first]), followups, whole,
                             NEW))
    assert [g.token_ids for g in ours] == [g.token_ids for g in full] and all(g.token_ids for g in ours)
    for gen in ours[1:]:  # each turn's ledger: its own decode steps (one per fed token), its own feed
        steps = gen.transfers[f"{'read' if name == 'quest' else 'h2d'}_bytes_per_step"]
        assert len(next(iter(steps.values()))) == len(gen.token_ids) - 1 and gen.transfers["feed_bytes"]


def test_quest_reset_conversation_asks_the_same_question_alike():
    model = tiny_model("llama", layers=3)
    context, question = prompt(120)[0].tolist(), prompt(6, seed=8)[0].tolist()
    with AttentionCapture(model) as capture:
        gens = list(converse(model, None, METHODS["quest"](page_size=8), capture, torch.tensor([context + question]),
                             [question, question], 24, NEW, mode="reset", question_len=6))
    assert gens[0].token_ids == gens[1].token_ids == gens[2].token_ids
    assert gens[0].transfers == gens[2].transfers  # a copy's ledger, restarted: the same reads each time


def test_quest_pqcache_are_accepted():
    def check(*overrides):
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            setup(compose("config", overrides=["model=tiny_llama", *overrides]))

    for method in ("quest", "pqcache"):
        check("query=agnostic", f"method={method}", "budget=256")
        check("dataset=niah_multiturn", "dataset.turns=2", f"method={method}", "budget=256")


def test_niah_multiturn_and_scbench_run_with_quest(tmp_path):
    from tests.unit.test_cli import records, run_here
    from tests.unit.test_scbench import FIXTURES

    _, recs = kvbench_run(tmp_path / "niah", "method=quest", "budget=32", "method.page_size=8", "dataset.turns=2",
                          "query=agnostic")
    assert [r["turn"] for r in recs] == [0, 1, 0, 1] and all("error" not in r for r in recs)
    assert recs[1]["kv_bytes"] > recs[0]["kv_bytes"] and recs[1]["transfers"]["feed_bytes"]
    scb = records(run_here("model=tiny_llama", "method=quest", "budget=32", "method.page_size=8", "dataset=scbench",
                           f"dataset.root={FIXTURES}", "dataset.tasks=[scbench_kv]", "dataset.limit_per_task=1",
                           "dataset.max_turns=2", "dataset.max_new_tokens=3", "dataset.turn_mode=append",
                           results=tmp_path / "scb"))
    assert [r["id"] for r in scb] == ["scbench_kv-0-t0", "scbench_kv-0-t1"] and all("error" not in r for r in scb)
    assert scb[1]["kv_bytes"] > scb[0]["kv_bytes"] and scb[1]["transfers"]["feed_bytes"]  # one growing cache
