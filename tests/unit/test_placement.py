"""`model.device_map`: per-layer placement from hand-made accelerate device maps, and a dispatched model on CPU.

Two GPUs are not available here; the placement arithmetic is checked on hand-made maps, and a tiny model dispatched
by accelerate (one layer's weights offloaded to disk, so its q_proj sits on the meta device behind a hook) must give
exactly the tokens and cache of the same model undispatched, through TailorKV's cross-layer query prediction.
"""
from __future__ import annotations

import copy

import pytest
import torch

import kvbench.methods  # noqa: F401
from kvbench.engine.batching import generate
from kvbench.methods.tailorkv import TailorKV
from kvbench.models import AttentionCapture, ModelSpec
from kvbench.models.placement import execution_device, layer_devices
from kvbench.registry import METHODS
from tests.unit.tiny import prompt, tiny_model

cuda = lambda i: torch.device("cuda", i)  # noqa: E731  (device objects need no GPU)
CPU = torch.device("cpu")


@pytest.mark.parametrize("device_map,expected", [
    ({"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 0, "model.layers.2": 1, "model.layers.3": 1,
      "model.norm": 1, "lm_head": 1}, [cuda(0), cuda(0), cuda(1), cuda(1)]),
    ({"model": 0, "model.layers.2": 1, "lm_head": 1}, [cuda(0), cuda(0), cuda(1), cuda(0)]),  # longest prefix wins
    ({"model.layers.1": 0, "model.layers.10": 1, "model": "cuda:1"}, [cuda(1), cuda(0), cuda(1), cuda(1)]),
    # weights offloaded to cpu/disk run on the map's first GPU (accelerate's main device), and so does their KV
    ({"model.embed_tokens": 1, "model.layers.0": 1, "model.layers.1": "cpu", "model.layers.2": "disk",
      "model.layers.3": 0}, [cuda(1), cuda(1), cuda(1), cuda(0)]),
    ({"": "cpu"}, [CPU] * 4),
    ({"model.layers.0.self_attn": 0, "model.layers.0.mlp": 1, "model.layers.1": 1, "model.layers.2": 1,
      "model.layers.3": "disk"}, [cuda(0), cuda(1), cuda(1), cuda(0)]),  # split below a layer: attention decides
])
def test_layer_devices_resolve_hand_made_maps(device_map, expected):
    assert layer_devices(device_map, 4) == expected


def test_a_map_that_misses_a_layer_fails_naming_it():
    with pytest.raises(ValueError, match="no entry places model.layers.1"):
        layer_devices({"model.layers.0": 0}, 2)


def test_device_map_is_validated_in_one_line():
    with pytest.raises(ValueError, match="device_map='everywhere' is not one of auto, balanced"):
        ModelSpec(name="m", path="x", device_map="everywhere")


def run(model, method, budget):
    with AttentionCapture(model, window=getattr(method, "window", 0)) as capture:
        return generate(model, None, method, capture, prompt(160), budget, 6, eos_ids=set())


@pytest.mark.parametrize("method,budget", [
    (lambda: METHODS["snapkv"](window=8), 48),
    (lambda: TailorKV(quant_layers=[0], start_size=4, recent_size=12, channels=4, group_size=16, residual=16), 64),
])
def test_a_dispatched_model_with_a_disk_offloaded_layer_matches_the_plain_model(tmp_path, method, budget):
    from accelerate import dispatch_model

    plain = tiny_model("llama", layers=3)
    mapped = dispatch_model(copy.deepcopy(plain), {
        "model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
        "model.layers.2": "cpu", "model.norm": "cpu", "lm_head": "cpu"}, main_device="cpu", offload_dir=str(tmp_path))
    q_proj = mapped.model.layers[1].self_attn.q_proj
    assert q_proj.weight.device.type == "meta" and execution_device(q_proj) == CPU  # the hook's device, not meta
    want, got = run(plain, method(), budget), run(mapped, method(), budget)
    assert got.token_ids == want.token_ids and got.kept_per_head == want.kept_per_head
    assert got.kv_bytes_per_layer == want.kv_bytes_per_layer and got.transfers == want.transfers
