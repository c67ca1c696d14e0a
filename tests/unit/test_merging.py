"""`+method.merge=true` (kvpress MergingPress): the merged values against a float64 loop over the rule in
kvbench/methods/merging.py, through the engine on a tiny model (merged values stored, only the kept entries), from the
command line's switches with their refusals, and against kvpress 0.5.5's merged values on the embedded model
(tests/fixtures/kvpress_merging/goldens.json, made by scripts/make_kvpress_goldens_merging.py)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import kvbench.methods  # noqa: F401
from kvbench.cache import KVCache
from kvbench.engine.batching import Request, generate_batched
from kvbench.engine.generation import prefill, prepare
from kvbench.engine.recompress import why_not
from kvbench.engine.static import StaticDecoder, unsupported
from kvbench.methods.base import LayerView
from kvbench.methods.merging import merged_kept_values
from kvbench.methods.wrappers import Merge, Switches, wrap
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from kvbench.runs.config import CONFIG_DIR, setup
from tests.unit.decidable import row_disagreements
from tests.unit.tiny import prompt, tiny_model

GOLDENS = Path(__file__).resolve().parents[1] / "fixtures/kvpress_merging/goldens.json"


def quantile(values: list[float], q: float) -> float:
    """torch.quantile's linear interpolation, by hand."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def merged_by_loop(keys, values, kept, threshold, fraction):
    """One head's kept values `[k, D]` after the merge, in float64, one evicted entry at a time."""
    keys, values = keys.double(), values.double()
    evicted = [i for i in range(keys.shape[0]) if i not in set(kept)]
    best = []
    for e in evicted:
        cos = [float(keys[e] @ keys[t] / (keys[e].norm() * keys[t].norm())) for t in kept]
        best.append(max(range(len(kept)), key=cos.__getitem__))
        best[-1] = (best[-1], cos[best[-1]])
    passing = [c >= threshold for _, c in best]
    if fraction < 1 and any(passing):
        cut = quantile([c if ok else -math.inf for (_, c), ok in zip(best, passing)], 1 - fraction)
        passing = [ok and c >= cut for (_, c), ok in zip(best, passing)]
    out = [values[t].clone() for t in kept]
    total = [0.0] * len(kept)
    for e, (t, c), ok in zip(evicted, best, passing):
        if ok:
            ve, vt = values[e].norm(), values[kept[t]].norm()
            w = max(c, 0.0) * float(ve / (ve + vt + 1e-6))
            out[t] += w * values[e]
            total[t] += w
    return torch.stack([v / (1 + s) if s > 0 else v for v, s in zip(out, total)])


@pytest.mark.parametrize("threshold, fraction", [(0.0, 1.0), (0.15, 0.6)])
def test_merged_values_equal_a_float64_loop(threshold, fraction):
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 2, 40, 8, generator=g) + torch.randn(1, 2, 1, 8, generator=g)  # cosines of both signs
    values = torch.randn(1, 2, 40, 8, generator=g) * torch.rand(1, 2, 40, 1, generator=g)
    kept = torch.stack([torch.randperm(40, generator=g)[:15] for _ in range(2)])[None]  # any order
    ours = merged_kept_values(keys, values, kept, threshold, fraction)
    for h in range(2):
        expected = merged_by_loop(keys[0, h], values[0, h], kept[0, h].tolist(), threshold, fraction)
        torch.testing.assert_close(ours[0, h].double(), expected, rtol=1e-5, atol=1e-6)
        assert (ours[0, h] != values[0, h, kept[0, h]]).any(-1).sum() >= 3  # the merge changed some


# --- the engine -----------------------------------------------------------------------------------------------------
def test_the_cache_stores_the_merged_kept_values_only():
    model, ids = tiny_model("llama", layers=2), prompt(96)
    full = KVCache()
    with torch.no_grad():
        prefill(model, ids, full)
    method = Merge(METHODS["snapkv"](window=8), threshold=0.1)
    for after in ("layer", "prefill"):  # inside the prefill forward (kvbench.engine.layerwise), and after it
        with AttentionCapture(model, window=method.query_window) as capture:
            prepared = prepare(model, method, capture, ids, 32, 4, compress_after=after)
        assert prepared.kept_per_head == [[32] * 2] * 2 and prepared.kv_bytes * 3 == prepared.full_kv_bytes
        for layer, whole in zip(prepared.cache.layers, full.layers):
            kept = layer.positions
            assert torch.equal(layer.keys, whole.keys.gather(2, kept[..., None].expand(-1, -1, -1, 16)))
            assert torch.equal(layer.values, merged_kept_values(whole.keys, whole.values, kept, 0.1))
            assert not torch.equal(layer.values, whole.values.gather(2, kept[..., None].expand(-1, -1, -1, 16)))


def test_the_static_step_decodes_the_merged_cache_as_the_eager_engine():
    model = tiny_model("llama", layers=2)
    method = Merge(METHODS["snapkv"](window=8))
    reqs = [Request(prompt(n, seed=i), 24, 6, tag=i) for i, n in enumerate((80, 60))]
    with AttentionCapture(model, window=method.query_window) as capture:
        eager = {r.tag: g for r, g in generate_batched(model, None, method, capture, reqs, 1)}
        static = {r.tag: g for r, g in StaticDecoder(model, None, method, capture, 2, eos_ids=set()).run(reqs)}
        plain = {r.tag: g for r, g in generate_batched(model, None, method.press, capture, reqs, 1)}
    for i in eager:
        assert static[i].step == "static" and static[i].token_ids == eager[i].token_ids
        assert static[i].kv_bytes == eager[i].kv_bytes == plain[i].kv_bytes
    assert any(eager[i].token_ids != plain[i].token_ids for i in eager)  # (the merge reaches the logits)


# --- the command line -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base_config():
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("config", overrides=["method=snapkv"])


def built(cfg, name, **keys):
    cfg = cfg.copy()
    cfg.method = OmegaConf.merge(OmegaConf.load(CONFIG_DIR / "method" / f"{name}.yaml"), keys)
    return setup(cfg)[0]


def test_the_switch_wraps_any_selector_and_refuses_in_one_line(base_config):
    method = built(base_config, "snapkv", merge=True, merge_threshold=0.2, merge_fraction=0.5, whole_layers=[0])
    assert isinstance(method, Merge) and (method.threshold, method.fraction) == (0.2, 0.5)
    assert method.label == "snapkv+per_layer+merge" and unsupported(method) is None  # static decodes what it stored
    assert "at prefill only" in why_not(method)  # decode_compression refused (kvpress: not a ScorerPress)
    assert type(built(base_config, "snapkv", merge=False)).__name__ == "SnapKV"
    for name, bad, says in [
            ("knorm", {"merge": True, "merge_fraction": 0}, r"method.merge_fraction=0 must be in \(0, 1\]"),
            ("knorm", {"merge": True, "merge_threshold": 1.5}, "method.merge_threshold=1.5 must be in"),
            ("knorm", {"merge_threshold": 0.5}, "add it"),
            ("adakv", {"merge": True}, "adakv keeps per-head variable layers"),
            ("rkv", {"merge": True}, "compresses again while decoding"),
            ("h2o", {"merge": True}, "wraps selectors only")]:
        with pytest.raises(ValueError, match=says) as e:
            built(base_config, name, **bad)
        assert "\n" not in str(e.value)


# --- kvpress's own merged values on the embedded model --------------------------------------------------------------
@pytest.fixture(scope="module")
def embedded():
    """The golden prompt's full cache on the embedded model, as the views `select` gets (one prefill)."""
    from kvbench.models import ModelSpec, load

    goldens = json.loads(GOLDENS.read_text())
    model, _ = load(ModelSpec(name="smollm2", path="embedded"))
    cache = KVCache()
    with AttentionCapture(model, window=64) as capture, torch.no_grad():
        prefill(model, torch.tensor([goldens["ids"]]), cache)
        views = [LayerView(i, len(cache.layers), layer.keys, layer.values, capture.window_queries[i],
                           capture.scaling[i]) for i, layer in enumerate(cache.layers)]
    return goldens, views


@pytest.mark.parametrize("case", ["knorm", "snapkv", "knorm_gated"])
def test_merged_values_equal_kvpress_on_the_embedded_model(case, embedded):
    goldens, views = embedded
    golden = goldens["cases"][case]
    method = wrap(METHODS[golden["method"]](**golden["fields"]), Switches(**golden["switches"]))
    n = views[0].prompt_len
    n_keep = int(n * (1 - goldens["ratio"]))
    probe = torch.cos(torch.arange(views[0].values.shape[-1], dtype=torch.float64))
    for view, heads in zip(views, golden["layers"]):
        kept = method.select(view, n_keep).sort(dim=-1).values
        merged = method.merged_values(view, kept)
        for h, want in enumerate(heads):
            ours, theirs = set(kept[0, h].tolist()), {i for i in range(n) if int(want["kept"], 16) >> i & 1}
            assert not row_disagreements(getattr(method, "press", method), view, h, ours,
                                         theirs, f"{case} {view.layer_idx} {h}")  # ties: tests/unit/decidable.py
            if "merged" in want and ours == theirs:  # (a tie swapped merges into other entries)
                ours = merged[0, h].double() @ probe
                torch.testing.assert_close(ours, torch.tensor(want["merged"], dtype=torch.float64),
                                           rtol=1e-4, atol=1e-4)
                plain = view.values[0, h, kept[0, h]].double() @ probe
                assert ((ours - plain).abs() > 1e-3).sum() > n_keep // 4, (case, view.layer_idx, h)
