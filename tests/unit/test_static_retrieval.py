"""The retrieval methods (Quest's pages, PQCache's codes) in the static decode step (`kvbench.cache.static_retrieval`):
captured whole by `torch.compile(fullgraph=True)` (0 graph breaks, 1 graph) while sequences join and leave, and the
same tokens and records (bytes held, the ledger's bytes per step) as the eager engine at batch 1, at batch 1 and N."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import kvbench.methods  # noqa: F401
from kvbench.cache.ranking import ranks, top_first
from kvbench.engine.batching import Request, generate_batched
from kvbench.engine.static import StaticDecoder, unsupported
from kvbench.models import AttentionCapture
from tests.unit.test_batching import FIELDS
from tests.unit.test_contract import configured
from tests.unit.tiny import prompt, tiny_model

RECORD = FIELDS + ("peak_kv_bytes", "kv_bytes_decode_peak", "kv_bytes_decode_mean")
BUDGET = 48  # Quest: 6 pages of 8; PQCache: 4 sinks + 8 recent + 36 retrieved


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return tiny_model("llama", layers=2)


def run_both(model, method, lengths, new, batch_sizes, **static):
    """Each prompt through the eager engine at batch 1, then through the static step at each of `batch_sizes`:
    the eager generations and, per batch size, the static ones, in request order."""
    prompts = [prompt(n, seed=i) for i, n in enumerate(lengths)]
    with AttentionCapture(model, window=method.query_window) as capture:
        def requests():
            return [Request(ids, BUDGET, k, seed=100 + i, tag=i) for i, (ids, k) in enumerate(zip(prompts, new))]
        eager = {r.tag: g for r, g in generate_batched(model, None, method, capture, requests(), 1)}
        runs = []
        for batch_size in batch_sizes:
            decoder = StaticDecoder(model, None, method, capture, batch_size, eos_ids=set(), **static)
            done = {r.tag: g for r, g in decoder.run(requests())}
            runs.append([done[i] for i in range(len(prompts))])
    return [eager[i] for i in range(len(prompts))], runs


def assert_same_records(eager, static):
    for one, other in zip(eager, static):
        assert not isinstance(other, Exception), other
        for name in RECORD:
            assert getattr(other, name) == getattr(one, name), name


@pytest.mark.parametrize("name", ["quest", "pqcache"])
def test_captured_once_and_equal_to_eager(model, name):
    """Batch 2 over 64 steps: the second sample leaves after 10 and the third joins in its row; one graph, no
    break; every record field equals the eager engine's (batch 1)."""
    torch._dynamo.reset()
    counters.clear()
    eager, (static,) = run_both(model, configured(name), [150, 70, 120], [64, 10, 20], [2], compile=True,
                                backend="eager")
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1
    assert [len(g.token_ids) for g in static] == [64, 10, 20]
    assert_same_records(eager, static)
    assert static[0].transfers["device_bytes_per_step"][-1] > static[0].transfers["device_bytes_per_step"][0]


@pytest.mark.parametrize("name, options, lengths", [
    ("quest", {}, [150, 70, 260, 120]),  # the 260-token prompt joins later and regrows every row
    ("quest", {"keep_last": False}, [150, 70, 120]),
    ("pqcache", {}, [150, 15, 260, 120]),  # 15 tokens: too short for codes, plain layers in the coded rows
])
def test_batch_n_equals_batch_1_and_eager(model, name, options, lengths):
    """Eagerly run static step (no compile) at batch 1 and 3: the eager engine's records, through a regrow to a
    larger capacity and rows with retrieval off."""
    method = configured(name)
    for key, value in options.items():
        setattr(method, key, value)
    eager, runs = run_both(model, method, lengths, [12, 4, 9, 12][:len(lengths)], [1, 3])
    for static in runs:
        assert_same_records(eager, static)


def test_retrieval_is_static_tailorkv_is_not():
    assert unsupported(configured("quest")) is None and unsupported(configured("pqcache")) is None
    assert "own storage" in unsupported(configured("tailorkv"))


def test_ties_go_to_the_earlier_entry():
    """One rule in the eager layers and the static rows: larger first, equal scores in index order, whatever the
    padding after them."""
    scores = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 2.0]])
    assert top_first(scores, 4).tolist() == [[1, 3, 2, 4]]
    padded = torch.cat([scores, torch.full((1, 9), float("-inf"))], dim=1)
    assert (ranks(padded)[:, :6] < 4).tolist() == [[False, True, True, True, True, False]]
