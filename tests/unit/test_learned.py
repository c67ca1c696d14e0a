"""The methods with learned or precomputed artefacts (qfilter, duo_attention, lukv, expected_attention's `stats`):
their loaders, against independent recomputations on tiny models, and against kvpress 0.5.5's kept or masked sets
on the embedded model (tests/fixtures/kvpress_learned/goldens.json, made by scripts/make_kvpress_goldens_learned.py
with the same artefacts).

The references take keys and values from transformers' own DynamicCache, rotary angles from the model's own
`rotary_emb` and `apply_rotary_pos_emb`, and write each score again as plain loops over heads.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import kvbench.methods  # noqa: F401
from kvbench.cache import KVCache
from kvbench.engine.generation import compress, prefill
from kvbench.methods import artefacts
from kvbench.methods.base import LayerView
from kvbench.methods.duo_attention import on_the_fly_scores, streaming_count
from kvbench.methods.lukv import head_counts
from kvbench.methods.qfilter import svd_filters
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from tests.unit.decidable import row_disagreements
from tests.unit.test_presses import scaled_model  # keys of varied norms and directions
from tests.unit.tiny import prompt, tiny_model

N, BUDGET = 90, 24
ROOT = Path(__file__).resolve().parents[2]
GOLDENS = ROOT / "tests/fixtures/kvpress_learned/goldens.json"


def compressed(model, ids, method, budget=BUDGET):
    cache = KVCache()
    with AttentionCapture(model, window=method.query_window) as capture:
        prefill(model, ids, cache)
        compress(method, cache, capture, budget)
    return cache


def kept_sets(layer) -> list[set[int]]:
    """Original positions each head of a compressed layer holds (dense or per-head variable)."""
    if getattr(layer, "is_varlen", False):
        return [set(p.tolist()) for p in layer.flat_positions.split(layer.head_lens.tolist())]
    return [set(p.tolist()) for p in layer.positions[0]]


def reference_cache(model, ids):
    cache = DynamicCache()
    with torch.no_grad():
        model(ids, past_key_values=cache)
    return cache


def top_set_ok(kept: set[int], scores: torch.Tensor, count: int) -> bool:
    """`kept` is a top-`count` set of `scores` (ties either way, fp32 rounding)."""
    mask = torch.zeros(len(scores), dtype=torch.bool)
    mask[sorted(kept)] = True
    return len(kept) == count and (mask.all() or bool(scores[mask].min() >= scores[~mask].max() - 1e-6))


# --- loaders ----------------------------------------------------------------------------------------------------------
def test_sources_are_checked_before_weights_load_and_hub_files_need_a_revision(tmp_path):
    with pytest.raises(ValueError, match="qfilter: filters='nope.safetensors' is not a file; give a path or one of"):
        METHODS["qfilter"](filters="nope.safetensors")
    with pytest.raises(ValueError, match="lukv: curve='prompt' is not a file; give a path or one of auto, uniform"):
        METHODS["lukv"](curve="prompt")
    with pytest.raises(ValueError, match="expected_attention: stats='prompt' is not a file"):
        METHODS["expected_attention"](stats="prompt")
    with pytest.raises(ValueError, match="duo_attention: head_ratio=1.5 must be in"):
        METHODS["duo_attention"](head_ratio=1.5)
    with pytest.raises(ValueError, match="qfilter: nthngdy/Llama-3.1-8B-Instruct_qfilt has no pinned revision"):
        artefacts.hub_file("nthngdy/Llama-3.1-8B-Instruct_qfilt", "model.safetensors", None, "qfilter")
    with pytest.raises(ValueError, match="lukv: baidu-baige/LU-KV has no pinned commit"):
        artefacts.github_file("baidu-baige/LU-KV", None, "x.npy", "lukv")
    pickled = tmp_path / "curve.npy"
    np.save(pickled, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="allow_pickle"):  # numpy refuses to unpickle
        artefacts.read_npy(pickled)


def test_qfilter_loads_a_safetensors_file_and_refuses_another_models(tmp_path):
    model = tiny_model("llama", layers=2)
    path = tmp_path / "model.safetensors"  # the layout PyTorchModelHubMixin.save_pretrained writes
    save_file({"q_filters": torch.randn(2, 2, 16)}, str(path))
    method = METHODS["qfilter"](filters=str(path))
    info = method.prepare(model, None)
    assert method.query_window == 0 and info["filters"]["file"] == str(path) and len(info["filters"]["sha256"]) == 64
    save_file({"q_filters": torch.randn(3, 2, 16)}, str(path))
    with pytest.raises(ValueError, match=r"qfilter: .* has shape \[3, 2, 16\], the model needs \[2, 2, 16\]"):
        METHODS["qfilter"](filters=str(path)).prepare(model, None)
    with pytest.raises(ValueError, match="qfilter: no published artefact for model ''"):
        METHODS["qfilter"]().prepare(model, None)


def test_the_embedded_models_artefacts_are_committed_with_its_shapes():
    filters = artefacts.read_safetensors(artefacts.embedded_file("qfilters", "safetensors"))["q_filters"]
    stats = artefacts.read_safetensors(artefacts.embedded_file("ea_stats", "safetensors"))
    duo = artefacts.read_tsv(artefacts.embedded_file("duo_attention", "tsv"))
    assert filters.shape == (30, 3, 64) and duo.shape == (30, 3)
    assert stats["query_mean"].shape == (30, 9, 64) and stats["query_cov"].shape == (30, 9, 64, 64)
    assert torch.isfinite(stats["query_cov"].float()).all() and ((0 <= duo) & (duo <= 1)).all()


# --- Q-Filters --------------------------------------------------------------------------------------------------------
def test_qfilter_keeps_the_keys_with_the_lowest_filter_product(tmp_path):
    model, ids = scaled_model(), prompt(N)
    filters = torch.randn(2, 2, 16, generator=torch.Generator().manual_seed(0))
    save_file({"q_filters": filters}, str(tmp_path / "f.safetensors"))
    method = METHODS["qfilter"](filters=str(tmp_path / "f.safetensors"))
    method.prepare(model, None)
    cache, ref = compressed(model, ids, method), reference_cache(model, ids)
    for layer in range(2):
        keys = ref.layers[layer].keys[0]
        for h, kept in enumerate(kept_sets(cache.layers[layer])):
            scores = torch.tensor([-float(filters[layer, h] @ keys[h, t]) for t in range(N)])
            assert top_set_ok(kept, scores, BUDGET), (layer, h)


def test_svd_filters_follow_the_dominant_query_direction_signed_by_most_queries():
    direction = torch.zeros(8)
    direction[2] = 1.0
    queries = 3 * direction + 0.1 * torch.randn(4, 200, 8, generator=torch.Generator().manual_seed(0))
    filters = svd_filters(queries, n_kv_heads=2)  # every query projects positively on +direction
    torch.testing.assert_close(filters, -direction.expand(2, 8), atol=0.02, rtol=0)
    torch.testing.assert_close(svd_filters(-queries, 2), direction.expand(2, 8), atol=0.02, rtol=0)


def test_qfilter_from_the_prompt_uses_the_window_queries():
    model, ids = scaled_model(layers=1), prompt(N)
    cache = compressed(model, ids, METHODS["qfilter"](filters="prompt", window=32))
    assert [len(s) for s in kept_sets(cache.layers[0])] == [BUDGET, BUDGET]


# --- DuoAttention -----------------------------------------------------------------------------------------------------
def write_pattern(tmp_path, scores, sink, recent) -> Path:
    tsv = tmp_path / "heads.tsv"
    tsv.write_text("".join("\t".join(str(s) for s in row) + "\n" for row in scores))
    tsv.with_suffix(".json").write_text(json.dumps({"sink_size": sink, "recent_size": recent}))
    return tsv


def test_duo_attention_streams_the_lowest_heads_of_the_whole_model(tmp_path):
    model, ids = tiny_model("llama", layers=3), prompt(N)
    scores = [[0.9, 0.1], [1.7, 0.3], [-0.2, 0.8]]  # clipped to [0, 1]: 1.0, 0.0 tie with nothing else
    method = METHODS["duo_attention"](pattern=str(write_pattern(tmp_path, scores, 4, 8)), head_ratio=0.5)
    method.prepare(model, None)
    cache = compressed(model, ids, method)
    streaming = {(l, h) for l, h in np.ndindex(3, 2) if np.clip(scores[l][h], 0, 1) < 0.5}  # the 3 lowest
    for layer in range(3):
        for h, kept in enumerate(kept_sets(cache.layers[layer])):
            expected = set(range(4)) | set(range(N - 8, N)) if (layer, h) in streaming else set(range(N))
            assert kept == expected, (layer, h)


def test_duo_attention_streams_as_few_heads_as_the_budget_needs(tmp_path):
    assert streaming_count(100, 40, 6, 4, 8) == 4  # 6 x 60 / 88 = 4.09 streaming heads: mean 41.3, nearest 40
    assert streaming_count(100, 10, 6, 4, 8) == 6 and streaming_count(10, 5, 6, 4, 8) == 6  # all; nothing to save
    assert streaming_count(100, 100, 6, 4, 8) == 0
    model, ids = tiny_model("llama", layers=3), prompt(N)
    method = METHODS["duo_attention"](pattern=str(write_pattern(tmp_path, np.arange(6).reshape(3, 2) / 6, 4, 8)))
    method.prepare(model, None)
    lens = [len(s) for layer in compressed(model, ids, method, budget=40).layers for s in kept_sets(layer)]
    assert abs(sum(lens) - 6 * 40) <= (N - 12) / 2 and lens[:4] == [12, 12, 12, 12]  # the 4 lowest stream


def test_on_the_fly_head_scores_equal_kvpress_formula():
    model = tiny_model("llama", layers=1)
    g = torch.Generator().manual_seed(0)
    q_mean, k_mean = 3 * torch.randn(6, 16, generator=g), 3 * torch.randn(2, 16, generator=g)
    q = q_mean[None, :, None].repeat(1, 1, 500, 1)  # kvpress: repeat q_len times, RoPE, last query's softmax
    k = k_mean[None, :, None].repeat(1, 1, 500, 1)
    cos, sin = model.model.rotary_emb(q, torch.arange(500)[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k = k.repeat_interleave(3, dim=1)
    weights = (q[:, :, -1:] @ k.transpose(2, 3) / 4).softmax(dim=-1).squeeze()
    expected = weights.cumsum(dim=1).mean(1).view(-1, 3).mean(1)
    capture_rotary = AttentionCapture(model, window=4)
    with capture_rotary as capture:
        prefill(model, prompt(8), KVCache())
        rotary = capture.rotary[0]
    torch.testing.assert_close(on_the_fly_scores(q_mean, k_mean, rotary), expected, rtol=1e-4, atol=1e-6)


# --- LU-KV ------------------------------------------------------------------------------------------------------------
def test_lukv_head_counts_follow_kvpress_rounding():
    # ideal keeps 45.5, 30.3, 14.2 of 100 -> floors 45, 30, 14; round(90.0) = 90: one more to the largest fraction
    assert head_counts(torch.tensor([0.545, 0.697, 0.858]), 100).tolist() == [46, 30, 14]
    assert head_counts(torch.tensor([1.0, 1.0]), 50).tolist() == [1, 1]  # at least one per head


def ea_scores(keys, values, mu, cov, n_sink=4, epsilon=0.02):
    """Expected Attention of one layer from rotated statistics (mu `[H_q, D]`, cov `[H_q, D, D]`), head by head."""
    h_kv, n, d = keys.shape
    group = mu.shape[0] // h_kv
    out = torch.zeros(h_kv, n, dtype=torch.float64)
    for h in range(h_kv):
        k = keys[h, n_sink:].double()
        per_query = [((mu[g].double() @ k.T) / math.sqrt(d) + torch.einsum("nd,de,ne->n", k, cov[g].double(), k)
                      / d / 2).softmax(-1) for g in range(h * group, (h + 1) * group)]
        out[h, n_sink:] = (sum(per_query) / group + epsilon) * values[h, n_sink:].double().norm(dim=-1)
    out[:, :n_sink] = out.max() + 1
    return out


def rotated_stats(model, mu, cov, n, n_future=512):
    """kvpress's apply_avg_rope, from the model's own rotary_emb: the mean of the rotation matrices of n..n+511."""
    d = mu.shape[-1]
    cos, sin = model.model.rotary_emb(mu[None], torch.arange(n, n + n_future)[None])
    half = torch.zeros(d, d)
    half[d // 2:, :d // 2], half[:d // 2, d // 2:] = torch.eye(d // 2), -torch.eye(d // 2)
    r = (cos[0][:, None] * torch.eye(d) + sin[0][:, None] * half).mean(dim=0)
    return mu @ r.T, r @ cov @ r.T


def test_expected_attention_with_stats_and_lukv_with_a_curve_keep_the_reference_sets(tmp_path):
    model, ids, layers = scaled_model(), prompt(N), 2
    g = torch.Generator().manual_seed(1)
    mu, a = torch.randn(layers, 6, 16, generator=g), torch.randn(layers, 6, 16, 16, generator=g) / 4
    cov = a @ a.transpose(-1, -2)
    save_file({"query_mean": mu, "query_cov": cov}, str(tmp_path / "stats.safetensors"))
    curve = np.random.default_rng(0).uniform(0.3, 0.9, (99, layers, 2)).astype(np.float32)
    np.save(tmp_path / "curve.npy", curve)
    stats = dict(stats=str(tmp_path / "stats.safetensors"))
    ea, lukv = METHODS["expected_attention"](epsilon=0.02, **stats), METHODS["lukv"](curve=str(tmp_path / "curve.npy"),
                                                                                     **stats)
    for method in (ea, lukv):
        method.prepare(model, None)
        assert method.query_window == 0
    ref = reference_cache(model, ids)
    ea_cache, lukv_cache = compressed(model, ids, ea), compressed(model, ids, lukv)
    target = round(100 * (1 - BUDGET / N)) - 1
    for layer in range(layers):
        scores = ea_scores(ref.layers[layer].keys[0], ref.layers[layer].values[0],
                           *rotated_stats(model, mu[layer], cov[layer], N))
        counts = head_counts(torch.as_tensor(curve[target, layer]), N).tolist()
        protected = scores.clone()
        protected[:, :4], protected[:, -1] = protected.max() + 1, protected.max() + 1
        for h in range(2):
            assert top_set_ok(kept_sets(ea_cache.layers[layer])[h], scores[h], BUDGET), (layer, h)
            assert top_set_ok(kept_sets(lukv_cache.layers[layer])[h], protected[h], counts[h]), (layer, h)


# --- kvpress's own kept sets on the embedded model --------------------------------------------------------------------
@pytest.fixture(scope="module")
def embedded():
    """The embedded model and each golden prompt's full-cache views (one prefill each, every query recorded)."""
    from kvbench.models import ModelSpec, load

    goldens = json.loads(GOLDENS.read_text())
    prompts = json.loads((ROOT / "tests/fixtures/kvpress_new/goldens.json").read_text())["prompts"]
    model, _ = load(ModelSpec(name="smollm2", path="embedded"))
    views = []
    with AttentionCapture(model, window=1 << 40) as capture:
        for golden in prompts:
            cache = KVCache()
            with torch.no_grad():
                prefill(model, torch.tensor([golden["ids"]]), cache)
            views.append([LayerView(i, len(cache.layers), layer.keys, layer.values, capture.window_queries[i],
                                    capture.scaling[i], rotary=capture.rotary.get(i))
                          for i, layer in enumerate(cache.layers)])
    return model, goldens, views


@pytest.mark.parametrize("case", ["qfilter", "ea_stats", "duo_attention", "lukv"])
def test_kept_sets_equal_kvpress_on_the_embedded_model(case, embedded):
    model, goldens, views = embedded
    golden = goldens["cases"][case]
    fields = {k: str(ROOT / v) if k in ("filters", "stats", "pattern", "curve") else v
              for k, v in golden["fields"].items()}
    method = METHODS[golden["method"]](**fields)
    method.prepare(model, None)
    for p, (prompt_golden, layers) in enumerate(zip(goldens["prompts"], views)):
        for view, heads in zip(layers, golden["kept"][p]):
            kept = method.select(view, prompt_golden["budget"])
            kept = kept if isinstance(kept, list) else kept[0]
            for h, mask in enumerate(heads):
                theirs = {i for i in range(view.prompt_len) if int(mask, 16) >> i & 1}  # ties: decidable.py
                assert not row_disagreements(method, view, h, set(kept[h].tolist()), theirs,
                                             f"{case} {p} {view.layer_idx} {h}")
