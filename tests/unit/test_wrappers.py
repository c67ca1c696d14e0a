"""kvpress's wrappers as switches on any selector (PerLayerCompression, Chunk, Block, Composed) and SimLayerKV:
against independent recomputations (plain loops over chunks, blocks and layers on random keys; transformers' eager
attention for SimLayerKV's laziness), through the engine on a tiny model (whole layers really held whole, lazy layers
really cut), from the command line's switches, and against kvpress 0.5.5's kept sets on the embedded model
(tests/fixtures/kvpress_wrappers/goldens.json, made by scripts/make_kvpress_goldens_wrappers.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import kvbench.methods  # noqa: F401
from kvbench.cache import KVCache
from kvbench.engine.batching import generate
from kvbench.engine.generation import compress, prefill
from kvbench.methods.base import LayerView
from kvbench.methods.simlayerkv import SimLayerKV, family_of
from kvbench.methods.wrappers import Block, Chunk, Compose, PerLayer, Switches, chunk_quotas, wrap
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from kvbench.runs.config import CONFIG_DIR, setup
from tests.unit.tiny import prompt, tiny_model

GOLDENS = Path(__file__).resolve().parents[1] / "fixtures/kvpress_wrappers/goldens.json"


def random_view(n=200, heads=2, d=16, seed=0, queries=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, heads, n, d, generator=g) * torch.rand(1, heads, n, 1, generator=g) * 3
    values = torch.randn(1, heads, n, d, generator=g)
    window = torch.randn(1, heads * 3, queries, d, generator=g) if queries else None
    return LayerView(0, 1, keys, values, window, d ** -0.5)


def as_sets(idx):
    return [set(row.tolist()) for row in idx[0]]


# --- chunk, block, compose, per-layer against loops ----------------------------------------------------------------
def test_chunk_keeps_each_chunks_share_by_its_own_scores():
    view, n_keep = random_view(n=200), 90
    ours = as_sets(Chunk(METHODS["keydiff"](block_size=0), chunk_length=64).select(view, n_keep))
    quotas = chunk_quotas([64, 64, 64, 8], n_keep)
    assert quotas == [28, 29, 29, 4]  # floors 28, 28, 28, 3; one each to the last three
    for h in range(2):
        expected = set()
        for c, start in enumerate(range(0, 200, 64)):
            keys = view.keys[0, h, start:start + 64].double()
            anchor = F.normalize(keys, dim=-1).mean(0)
            scores = [-F.cosine_similarity(k, anchor, dim=0).item() for k in keys]
            expected |= {start + i for i in sorted(range(len(scores)), key=lambda i: -scores[i])[:quotas[c]]}
        assert ours[h] == expected


def test_block_generalises_keydiffs_pass_and_knorm_is_block_invariant():
    view = random_view(n=300)
    for n_keep in (50, 128):
        keydiff = METHODS["keydiff"]()  # block-wise by itself (blocks of 128)
        wrapped = Block(METHODS["keydiff"](block_size=0), block_size=128)
        assert torch.equal(wrapped.select(view, n_keep), keydiff.select(view, n_keep))
        knorm = METHODS["knorm"]()
        assert torch.equal(Block(knorm, 64).select(view, n_keep), knorm.select(view, n_keep))


def test_compose_scores_the_second_method_on_what_the_first_kept():
    view = random_view(n=160, queries=8)
    snapkv = METHODS["snapkv"](window=8, kernel=5, pooling="avg")
    first = snapkv.select(view, 80)
    ours = Compose(snapkv, METHODS["knorm"](), first_ratio=0.5).select(view, 30)
    for h in range(2):
        kept = first[0, h].tolist()
        norms = [view.keys[0, h, i].double().norm().item() for i in kept]
        expected = {kept[i] for i in sorted(range(80), key=lambda i: norms[i])[:30]}
        assert set(ours[0, h].tolist()) == expected


def test_per_layer_budgets_and_refusals():
    snapkv = METHODS["snapkv"](window=8)
    assert PerLayer(snapkv, [0, 2]).layer_budgets(100, 4, 32) == [100, 32, 100, 32]
    assert PerLayer(snapkv, layer_ratios=[0, 0.5, 0.75, 0.25]).layer_budgets(100, 4, 32) == [100, 50, 25, 75]
    with pytest.raises(ValueError, match="one per layer"):
        PerLayer(snapkv, layer_ratios=[0.5]).layer_budgets(100, 4, 32)
    with pytest.raises(ValueError, match="names a layer the model lacks"):
        PerLayer(snapkv, [7]).layer_budgets(100, 4, 32)
    with pytest.raises(ValueError, match="scores every entry from keys and values alone"):
        Chunk(snapkv, 64)
    with pytest.raises(ValueError, match="wraps selectors only"):
        Chunk(METHODS["h2o"](), 64)


def test_whole_layers_are_really_held_whole_through_the_engine():
    model, ids = tiny_model("llama", layers=3), prompt(120)
    method = PerLayer(METHODS["snapkv"](window=8), [0])
    with AttentionCapture(model, window=method.query_window) as capture:
        gen = generate(model, None, method, capture, ids, 32, 4, eos_ids=set())
    assert [layer[0] for layer in gen.kept_per_head] == [120, 32, 32]
    assert gen.kv_bytes == gen.full_kv_bytes * (120 + 32 + 32) / (3 * 120)  # stored, not masked


# --- the command line -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base_config():
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("config", overrides=["method=snapkv"])  # one compose; each case swaps the method node


def built(cfg, name, **keys):
    """`setup`'s method for `method=<name>` with `keys` in its node (`+method.<key>=...` on the command line)."""
    cfg = cfg.copy()
    cfg.method = OmegaConf.merge(OmegaConf.load(CONFIG_DIR / "method" / f"{name}.yaml"), keys)
    return setup(cfg)[0]


def test_switches_on_the_command_line_wrap_the_method(base_config):
    method = built(base_config, "snapkv", whole_layers=[0], window=16)
    assert isinstance(method, PerLayer) and method.press.window == 16 and method.query_window == 16
    method = built(base_config, "snapkv", then="knorm", first_ratio=0.5)
    assert isinstance(method, Compose) and method.then.registry_name == "knorm"
    assert isinstance(built(base_config, "knorm", chunk_length=64), Chunk)
    assert type(built(base_config, "keydiff", block_size=64)).__name__ == "KeyDiff"  # its own field
    for bad, says in [({"first_ratio": 1.5}, "method.first_ratio=1.5 must be in"), ({"then": "knorm"}, "go together"),
                      ({"then": "knrom", "first_ratio": 0.5}, "Did you mean"),
                      ({"chunk_length": 64}, "reads queries or keeps a window")]:
        with pytest.raises(ValueError, match=says):
            built(base_config, "snapkv", **bad)


# --- SimLayerKV -----------------------------------------------------------------------------------------------------
def test_simlayerkv_lazy_layers_match_an_eager_recomputation_and_are_really_cut():
    model, ids = tiny_model("llama", layers=4, attn="eager"), prompt(100)
    with torch.no_grad():
        rows = [a[0, :, -1].mean(0) for a in model(ids, output_attentions=True).attentions]  # last query, head mean
    masses = [float(row[:4].sum() + row[-16:].sum()) for row in rows]  # the authors': its own key among the recent
    threshold = sorted(masses)[1] + 1e-4  # two layers lazy
    lazy = [m > threshold for m in masses]
    assert sum(lazy) == 2
    model.set_attn_implementation("sdpa")
    method, cache = SimLayerKV(lazy_threshold=threshold), KVCache()
    with AttentionCapture(model, window=method.query_window) as capture:
        prefill(model, ids, cache)
        compress(method, cache, capture, 16)
    for is_lazy, layer in zip(lazy, cache.layers):
        expected = list(range(4)) + list(range(85, 100)) if is_lazy else list(range(100))
        assert layer.positions[0, 0].tolist() == expected
        assert layer.keys.shape[-2] == (19 if is_lazy else 100)  # stored, not masked


def test_simlayerkv_thresholds_by_family_and_short_prompts():
    class Config:
        def __init__(self, model_type, vocab_size):
            self.model_type, self.vocab_size = model_type, vocab_size
    assert [family_of(Config(*c)) for c in [("llama", 128256), ("llama", 32000), ("mistral", 32000),
                                            ("qwen2", 151936), ("llama", 49152)]] == [
        "llama3", "llama2", "mistral", "qwen", ""]
    assert SimLayerKV().layer_budgets(69, 2, 64) == [69, 69]  # not longer than sinks + recent + n_last
    assert SimLayerKV().layer_budgets(70, 2, 64) == [67, 67]
    with pytest.raises(ValueError, match="must be above n_last"):
        SimLayerKV(n_last=4).check_budget(4)


# --- kvpress's own kept sets on the embedded model ------------------------------------------------------------------
@pytest.fixture(scope="module")
def embedded_views():
    """Each golden prompt's full cache on the embedded model, as the views `select` gets (one prefill each)."""
    from kvbench.models import ModelSpec, load

    goldens = json.loads(GOLDENS.read_text())
    model, _ = load(ModelSpec(name="smollm2", path="embedded"))
    views = []
    with AttentionCapture(model, window=64) as capture:
        for golden in goldens["prompts"]:
            cache = KVCache()
            with torch.no_grad():
                prefill(model, torch.tensor([golden["ids"]]), cache)
            views.append([LayerView(i, len(cache.layers), layer.keys, layer.values, capture.window_queries[i],
                                    capture.scaling[i]) for i, layer in enumerate(cache.layers)])
    return goldens, views


@pytest.mark.parametrize("case", ["per_layer_snapkv", "chunk_knorm", "chunk_keydiff", "block_knorm", "block_keydiff",
                                  "compose_snapkv_knorm", "simlayerkv_0.85", "simlayerkv_0.55"])
def test_kept_sets_equal_kvpress_on_the_embedded_model(case, embedded_views):
    goldens, views = embedded_views
    golden = goldens["cases"][case]
    switches = Switches(**golden.get("switches", {}))
    then = METHODS[switches.then]() if switches.then else None
    method = wrap(METHODS[golden["method"]](**golden["fields"]), switches, then)
    whole = 0
    for p, layers in enumerate(views):
        n = layers[0].prompt_len
        if case.startswith("per_layer"):
            assert method.layer_budgets(n, len(layers), 1) == golden["budgets"][p]
        for view, heads, n_keep in zip(layers, golden["kept"][p], golden["budgets"][p]):
            kept = method.select(view, n_keep) if n_keep < n else None
            whole += kept is None
            for h, mask in enumerate(heads):
                ours = set(range(n)) if kept is None else set(kept[0, h].tolist())
                assert ours == {i for i in range(n) if int(mask, 16) >> i & 1}, (case, p, view.layer_idx, h)
    if case.startswith("simlayerkv"):
        assert 0 < whole < 60  # both kinds of layer occur


# --- composition: `then` composed with the run's model; a layer the first keeps whole ----------------------------
def test_a_then_methods_yaml_reads_the_runs_model(tmp_path, monkeypatch):
    """`then`'s YAML is composed with the model, as the first method's is (before: loaded alone, so a
    `${model.<key>}` failed to resolve and `oc.select` got its default)."""
    from kvbench.runs import config
    from kvbench.runs.validate import BadInput, validate

    with pytest.raises(BadInput, match="then=kvzip must be a selector too"):  # before: "'model.chat_template' not found"
        validate(["method=snapkv", "+method.then=kvzip", "+method.first_ratio=0.5", "ratio=0.75"])
    (tmp_path / "method").mkdir()
    (tmp_path / "method/mine.yaml").write_text("_target_: kvbench.methods.snapkv.SnapKV\nwindow: ${model.w}\n"
                                              "kernel: ${oc.select:model.k,1}\n")
    monkeypatch.setattr(config, "CONFIG_DIR", tmp_path)
    node = OmegaConf.create({"_target_": "kvbench.methods.snapkv.SnapKV", "window": 16, "then": "mine",
                             "first_ratio": 0.5})
    method = config.build_method(node, model=OmegaConf.create({"w": 12, "k": 3}))
    assert (method.then.window, method.then.kernel) == (12, 3)


def test_simlayerkv_first_hands_a_layer_it_keeps_whole_to_then(embedded_views):
    """kvpress's ComposedPress hands each press the layer the previous one left: a non-lazy layer, whole, goes to the
    second press. Before, Compose failed on it ("heads of different lengths"). Knorm's picks recomputed by hand."""
    _, views = embedded_views
    layers, n_keep = views[0], 40
    n = layers[0].prompt_len
    simlayerkv = SimLayerKV(lazy_threshold=0.55, reading="kvpress")
    method = Compose(simlayerkv, METHODS["knorm"](), first_ratio=0.75)
    whole = 0
    for view in layers:
        lazy = simlayerkv.select(view, int(n * 0.25))
        whole += lazy is None
        kept = method.select(view, n_keep)
        for h in range(view.keys.shape[1]):
            pool = range(n) if lazy is None else lazy[0, h].tolist()
            norms = {i: view.keys[0, h, i].double().norm().item() for i in pool}
            assert set(kept[0, h].tolist()) == set(sorted(pool, key=norms.get)[:n_keep]), (view.layer_idx, h)
    assert 0 < whole < len(layers)  # both kinds of layer occur


def test_simlayerkv_then_knorm_runs_from_the_command_line_and_stores_the_budget(base_config):
    """lazy_threshold=1: no layer is lazy, every one goes whole to knorm, which keeps the budget, stored for real."""
    method = built(base_config, "simlayerkv", lazy_threshold=1.0, then="knorm", first_ratio=0.5)
    assert not method.may_keep_whole
    model, ids = tiny_model("llama", layers=3), prompt(120)
    with AttentionCapture(model, window=method.query_window) as capture:
        gen = generate(model, None, method, capture, ids, 32, 4, eos_ids=set())
    assert [layer[0] for layer in gen.kept_per_head] == [32, 32, 32]
    assert gen.kv_bytes == gen.full_kv_bytes * 32 / 120
    with pytest.raises(ValueError, match="then=simlayerkv may keep a layer whole"):
        built(base_config, "snapkv", then="simlayerkv", first_ratio=0.5)


def test_a_wrapper_has_the_capabilities_of_what_it_wraps_and_refuses_what_it_cannot_hand_on():
    """Ada-KV under per-layer budgets keeps per-head layers, so compression while decoding refuses it as it refuses
    Ada-KV; methods that need the engine beyond `select` (a threshold, scores of the layers' inputs, R-KV's own
    decoding schedule) are refused when wrapped (each was silently run as a plain selector before)."""
    from kvbench.engine.recompress import why_not

    adakv = wrap(METHODS["adakv"](), Switches(whole_layers=[0]))
    assert adakv.own_storage and why_not(adakv) == why_not(METHODS["adakv"]())
    assert wrap(METHODS["simlayerkv"](), Switches(whole_layers=[0])).may_keep_whole
    assert not wrap(METHODS["snapkv"](), Switches(whole_layers=[0])).own_storage
    for name, why in [("dms", "score threshold"), ("kvzap", "score threshold"), ("rkv", "its own schedule")]:
        with pytest.raises(ValueError, match=f"{name}\\+per_layer: {name} .*{why}.*use it unwrapped"):
            wrap(METHODS[name](), Switches(whole_layers=[0]))
