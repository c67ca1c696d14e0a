"""Quest's page retrieval and PQCache's product-quantized retrieval, each against a recomputation written here in
float64 (page bounds, selected pages, K-means, codes, top-k), and the decode step's output against dense attention
over exactly the entries they select."""
from __future__ import annotations

import math

import pytest
import torch

import kvbench.methods  # noqa: F401
from kvbench.attention.decode import attend, decode_attention
from kvbench.cache import pq
from kvbench.cache.kv_cache import KVLayer
from kvbench.cache.ledger import TransferLedger
from kvbench.cache.paged import READS, PagedLayer
from kvbench.cache.pq_offloaded import MOVES, PQOffloadedLayer
from kvbench.engine.batching import generate
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from tests.unit.tiny import prompt, tiny_model

H_Q, H_KV, D = 6, 2, 16
G = H_Q // H_KV


def filled_layer(n: int, seed: int = 0) -> KVLayer:
    g = torch.Generator().manual_seed(seed)
    layer = KVLayer()
    layer.update(torch.randn(1, H_KV, n, D, generator=g), torch.randn(1, H_KV, n, D, generator=g))
    return layer


def random(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def attention_over(query, keys, values, entries):
    """float64 softmax attention of each query head h over `entries[h]` (positions into its KV head's keys)."""
    out = torch.zeros(1, 1, H_Q, D, dtype=torch.float64)
    for h in range(H_Q):
        k, v = keys[0, h // G, entries[h]].double(), values[0, h // G, entries[h]].double()
        p = torch.softmax(k @ query[0, h, 0].double() / math.sqrt(D), dim=0)
        out[0, 0, h] = p @ v
    return out


# --- Quest ------------------------------------------------------------------------------------------------------
def hand_pages(query, keys, page, budget_pages, keep_last):
    """Pages per query head, from bounds written out page by page and dim by dim: max(q_d min_d, q_d max_d)."""
    t = keys.shape[2]
    n_pages = -(-t // page)
    chosen = []
    for h in range(H_Q):
        q, k = query[0, h, 0].double(), keys[0, h // G].double()
        bounds = []
        for p in range(n_pages):
            block = k[p * page:min((p + 1) * page, t)]
            low, high = block.min(0).values, block.max(0).values
            bounds.append(sum(max(q[d] * low[d], q[d] * high[d]) for d in range(D)).item())
        bounds = torch.tensor(bounds)
        if keep_last:
            chosen.append(set(bounds[:-1].topk(budget_pages - 1).indices.tolist()) | {n_pages - 1})
        else:
            chosen.append(set(bounds.topk(max(3, budget_pages)).indices.tolist()))
    return chosen


@pytest.mark.parametrize("keep_last", [True, False])
def test_quest_pages_and_output_equal_hand_recompute(keep_last):
    """45 prompt tokens + 4 appended (pages of 8, the last partial): the bounds the layer keeps up to date equal
    min/max recomputed from scratch, the pages each query head attends equal the hand-computed top bounds, and the
    step's output equals dense attention over exactly those pages' entries."""
    ledger = TransferLedger(READS)
    layer = PagedLayer.from_layer(filled_layer(45), 8, 3, ledger, keep_last)
    layer.selections = []
    for step in range(4):
        layer.update(random(1, H_KV, 1, D, seed=10 + step), random(1, H_KV, 1, D, seed=20 + step))
    keys, values, t = layer.keys, layer.values, 49
    for p in range(7):
        block = keys[:, :, p * 8:min(p * 8 + 8, t)]
        assert torch.equal(layer.page_min[:, :, p], block.amin(2)) and torch.equal(layer.page_max[:, :, p],
                                                                                   block.amax(2))
    query = random(1, H_Q, 1, D, seed=3) * 3
    ledger.begin_step(0)
    out = attend(layer, query, 1 / math.sqrt(D))
    pages = hand_pages(query, keys, 8, 3, keep_last)
    assert [set(s.tolist()) for s in layer.selections[0][0]] == pages
    entries = [[i for p in sorted(pages[h]) for i in range(p * 8, min(p * 8 + 8, t))] for h in range(H_Q)]
    torch.testing.assert_close(out.double(), attention_over(query, keys, values, entries), rtol=1e-5, atol=1e-6)
    # reads: the metadata of all 7 pages; per KV head the union of its 3 query heads' pages
    union = [set().union(*pages[kv * G:(kv + 1) * G]) for kv in range(H_KV)]
    read_entries = sum(min(8, t - p * 8) for pages_kv in union for p in pages_kv)
    summary = ledger.summary()["read_bytes_per_step"]
    assert summary["page_metadata"] == [2 * H_KV * 7 * D * 4]
    assert summary["page_keys"] == summary["page_values"] == [read_entries * D * 4]


def test_quest_within_budget_attends_everything_and_generation_matches_full():
    """A budget covering the whole sequence reproduces the full cache's tokens; a small one holds the whole cache
    plus its page metadata and attends at most the budget in the sparse layers."""
    model, ids = tiny_model("llama", layers=3), prompt(100)
    with AttentionCapture(model) as capture:
        full = generate(model, None, METHODS["full"](), capture, ids, None, 6, eos_ids=set())
        exact = generate(model, None, METHODS["quest"](page_size=16, dense_layers=0), capture, ids, 112, 6,
                         eos_ids=set())
        small = generate(model, None, METHODS["quest"](page_size=16), capture, ids, 48, 6, eos_ids=set())
    assert exact.token_ids == full.token_ids
    metadata = 2 * H_KV * 7 * D * 4  # 7 pages of 16 over 100 tokens, min and max, fp32
    assert small.kv_bytes == full.kv_bytes + metadata  # layer 0 and 1 dense: no metadata; layer 2 paged
    assert small.kept_per_head == [[100, 100], [100, 100], [48, 48]]
    reads = small.transfers["read_bytes_per_step"]
    per_entry = H_KV * D * 4
    assert reads["page_keys"][0] <= 2 * 101 * per_entry + 3 * 16 * G * per_entry  # dense layers + <= 3 pages
    assert reads["page_metadata"] == [metadata] * 5


def test_rows_per_query_head_beside_rows_per_kv_head_attend_as_alone():
    """The padded path (CUDA's without flash-attn) given Quest's per-query-head rows beside dense and PQCache rows
    (per KV head) attends each as the per-sequence path does: one call per head layout, rows and logits in order."""
    quest = PagedLayer.from_layer(filled_layer(45, seed=1), 8, 3, TransferLedger(READS))
    dense = filled_layer(30, seed=2)
    pqc = PQOffloadedLayer.from_layer(filled_layer(90, seed=3), 4, 8, 20, 2, 4, 2, 0, TransferLedger(MOVES))
    query = random(3, H_Q, 1, D, seed=4) * 3
    kvs = [dense.decode_kv(query[:1]), quest.decode_kv(query[1:2]), pqc.decode_kv(query[2:])]
    assert [kv.keys.shape[1] for kv in kvs] == [H_KV, H_Q, H_KV]
    alone, alone_logits = decode_attention(query, kvs, [0.25, 0.3, 0.2], return_logits=True, padded=False)
    together, logits = decode_attention(query, kvs, [0.25, 0.3, 0.2], return_logits=True, padded=True)
    torch.testing.assert_close(together, alone)
    torch.testing.assert_close(logits, alone_logits)


# --- PQCache ----------------------------------------------------------------------------------------------------
def lloyd(x, n_clusters, iters, seed):
    """Plain float64 Lloyd: the same seeded initial rows, `iters` rounds, empty clusters kept."""
    first = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))[:n_clusters]
    x = x.double()
    cent = x[first].clone()
    for _ in range(iters):
        labels = torch.cdist(x, cent).argmin(1)
        cent = torch.stack([x[labels == c].mean(0) if (labels == c).any() else cent[c] for c in range(n_clusters)])
    return cent, torch.cdist(x, cent).argmin(1)


def test_kmeans_equals_plain_lloyd_and_is_deterministic():
    x = random(3, 300, 8, seed=5)
    centroids, labels = pq.kmeans(x, 16, iters=4, seed=7, tol=0.0)
    for g in range(3):
        cent, lab = lloyd(x[g], 16, 4, 7)
        torch.testing.assert_close(centroids[g].double(), cent, rtol=1e-5, atol=1e-5)
        assert torch.equal(labels[g], lab)
    again = pq.kmeans(x, 16, iters=4, seed=7, tol=0.0)
    assert torch.equal(again[0], centroids) and torch.equal(again[1], labels)


def hand_topk(query, layer, n_topk):
    """Top-k candidates per KV head from keys rebuilt from codes: Σ over the group of softmax(q·k̂ / sqrt(D)); among
    equal weights (keys of the same codes) the earlier candidate."""
    chosen = []
    for kv in range(H_KV):
        cent, codes = layer.centroids[0, kv].double(), layer.codes[0, kv, :, :layer.n_cand].long()
        approx = torch.cat([cent[m][codes[m]] for m in range(cent.shape[0])], dim=1)  # [N, D]
        weight = sum(torch.softmax(approx @ query[0, h, 0].double() / math.sqrt(D), 0)
                     for h in range(kv * G, (kv + 1) * G))
        chosen.append(set((weight.sort(descending=True, stable=True).indices[:n_topk] + layer.sink).tolist()))
    return chosen


def test_pqcache_selection_window_and_ledger_equal_hand_recompute():
    """120 prompt tokens, 4 sinks, window 8, top-20, 2 partitions x 16 centroids. Over 3 steps: the codebook is the
    K-means of keys 4..119; each step's top-k equals the hand-computed one; the output equals dense attention over
    sinks + top-k + window; a generated token leaving the window gets its nearest centroid; every byte is counted."""
    n, sink, recent, topk = 120, 4, 8, 20
    source = filled_layer(n)
    keys, values = source.keys.clone(), source.values.clone()
    ledger = TransferLedger(MOVES)
    layer = PQOffloadedLayer.from_layer(source, sink, recent, topk, 2, 4, 3, 0, ledger)
    layer.selections = []
    cent, codes = pq.train(keys[:, :, sink:], 2, 4, 3, 0)
    torch.testing.assert_close(layer.centroids, cent)
    assert torch.equal(layer.codes[..., :n - sink], codes)
    for step in range(10):
        k_new, v_new = random(1, H_KV, 1, D, seed=30 + step), random(1, H_KV, 1, D, seed=40 + step)
        keys, values = torch.cat([keys, k_new], 2), torch.cat([values, v_new], 2)
        ledger.begin_step(0)
        layer.update(k_new, v_new)
        query = random(1, H_Q, 1, D, seed=50 + step) * 3
        candidates = n - sink - recent + step
        assert layer.n_cand == candidates
        out = attend(layer, query, 1 / math.sqrt(D))
        picked = hand_topk(query, layer, topk)
        assert [set(s.tolist()) for s in layer.selections[-1][0]] == picked
        t = n + step + 1
        window = list(range(t - recent - 1, t))
        entries = [list(range(sink)) + sorted(picked[h // G]) + window for h in range(H_Q)]
        torch.testing.assert_close(out.double(), attention_over(query, keys, values, entries), rtol=1e-5,
                                   atol=1e-6)
    # the first generated token (position 120) left the window at step 9: host row 120 - 4, its nearest centroid
    row = n - sink
    assert torch.equal(layer.host_keys[:, :, row], keys[:, :, n])
    for kv in range(H_KV):
        for m in range(2):
            sub = keys[0, kv, n, m * 8:(m + 1) * 8].double()
            nearest = ((layer.centroids[0, kv, m].double() - sub) ** 2).sum(1).argmin()
            assert layer.codes[0, kv, m, row] == nearest
    moved = ledger.summary()
    h2d, d2h = moved["h2d_bytes_per_step"], moved["d2h_bytes_per_step"]
    assert h2d["pq_codes"] == [H_KV * 2 * (n - sink - recent + s) for s in range(10)]  # one byte per code
    assert h2d["pq_centroids"] == [H_KV * 2 * 16 * 8 * 4] * 10
    assert h2d["topk_keys"] == h2d["topk_values"] == [H_KV * topk * D * 4] * 10
    assert d2h["window_keys"] == [0] + [H_KV * D * 4] * 9  # from step 2 on, one token leaves per step
    assert moved["d2h_prefill_bytes"] == (2 * H_KV * (n - sink - recent) * D * 4 + H_KV * 2 * (n - sink)
                                          + H_KV * 2 * 16 * 8 * 4)


def test_pqcache_fetching_every_candidate_matches_full():
    """Top-k covering every candidate attends everything: the full cache's tokens."""
    model, ids = tiny_model("llama", layers=3), prompt(100)
    with AttentionCapture(model) as capture:
        full = generate(model, None, METHODS["full"](), capture, ids, None, 6, eos_ids=set())
        exact = generate(model, None, METHODS["pqcache"](sink_size=4, recent_size=4, bits=4), capture, ids, 120,
                         6, eos_ids=set())
        small = generate(model, None, METHODS["pqcache"](sink_size=4, recent_size=4, bits=4), capture, ids, 24,
                         6, eos_ids=set())
    assert exact.token_ids == full.token_ids
    assert small.kept_per_head == [[24, 24]] * 3
    assert small.kv_bytes == 3 * 2 * 8 * H_KV * D * 4  # sinks + window K/V per layer, fp32
    assert small.transfers["h2d_bytes_per_step"]["topk_keys"] == [3 * 16 * H_KV * D * 4] * 5


def test_bad_settings_fail_in_one_line():
    with pytest.raises(ValueError, match="page_size"):
        METHODS["quest"](page_size=0)
    with pytest.raises(ValueError, match="at least one page"):
        METHODS["quest"]().check_budget(8)
    with pytest.raises(ValueError, match="bits"):
        METHODS["pqcache"](bits=9)
    with pytest.raises(ValueError, match="must exceed sink_size"):
        METHODS["pqcache"]().check_budget(64)
