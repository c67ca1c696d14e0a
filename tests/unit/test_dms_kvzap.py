"""DMS and KVzap (kvbench/methods/dms.py, kvzap.py) against an independent recomputation on a tiny model.

The reference runs the plain transformers model (its own cache, hooks on each attention module for the inputs),
scores every entry itself (-‖k‖; the surrogate rebuilt as torch modules, as kvpress's KVzapModel holds it) and keeps,
per layer and KV head, the window plus the entries outside it scoring at least the threshold. kvbench must keep
exactly those, stored per head (the bytes are the kept entries), and load surrogates from safetensors only."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from transformers import DynamicCache

import kvbench.methods  # noqa: F401
from kvbench.engine.generation import prepare
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from tests.unit.tiny import prompt, tiny_model

N, WINDOW = 120, 16


def kept_positions(cache) -> list[list[set[int]]]:
    out = []
    for layer in cache.layers:
        heads = layer.flat_positions.split(layer.head_lens.tolist()) if getattr(layer, "is_varlen", False) else \
            list(layer.positions[0])
        out.append([set(h.tolist()) for h in heads])
    return out


@torch.no_grad()
def reference(model, ids, score_of, threshold: float) -> list[list[set[int]]]:
    """Plain forward; `score_of(layer, hidden, keys)` -> `[H_kv, n]`; the window + what scores >= threshold."""
    inputs = {}
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda module, args, kwargs: inputs.__setitem__(module.layer_idx, kwargs["hidden_states"][0]),
        with_kwargs=True) for layer in model.model.layers]
    cache = DynamicCache()
    try:
        model(ids, past_key_values=cache)
    finally:
        for hook in hooks:
            hook.remove()
    kept = []
    for i, layer in enumerate(cache.layers):
        scores = score_of(i, inputs[i], layer.keys[0])
        kept.append([{j for j in range(N - WINDOW) if scores[h, j] >= threshold} | set(range(N - WINDOW, N))
                     for h in range(scores.shape[0])])
    return kept


def run(model, method, ids):
    with AttentionCapture(model) as capture:
        return prepare(model, method, capture, ids, None, 1)


def test_dms_evicts_below_the_threshold_outside_the_window():
    model, ids = tiny_model("llama", layers=2), prompt(N)
    out = run(model, METHODS["dms"](threshold=-0.8, window=WINDOW), ids)
    expected = reference(model, ids, lambda i, hidden, keys: -keys.norm(dim=-1), -0.8)
    assert kept_positions(out.cache) == expected
    sizes = {len(h) for layer in expected for h in layer}
    assert len(sizes) > 1 and min(sizes) > WINDOW and max(sizes) < N  # heads keep different counts
    d = model.config.hidden_size // model.config.num_attention_heads
    assert out.kv_bytes == 2 * sum(len(h) for layer in expected for h in layer) * d * 4 < out.full_kv_bytes


def write_surrogate(folder, modules: list[nn.Module], hidden_dim) -> None:
    """A surrogate in KVzapModel.save_pretrained's layout: config.json + model.safetensors (`layers.<i>.` keys)."""
    folder.mkdir()
    save_file({f"layers.{i}.{k}": v.contiguous() for i, m in enumerate(modules) for k, v in m.state_dict().items()},
              str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "kvzap", "input_dim": 96, "output_dim": 2,
                                                    "hidden_dim": hidden_dim, "n_modules": len(modules)}))


@pytest.mark.parametrize("model_type", ["linear", "mlp"])
def test_kvzap_scores_the_attention_input_with_the_surrogate(tmp_path, model_type):
    model, ids = tiny_model("llama", layers=2), prompt(N)
    torch.manual_seed(3)
    if model_type == "linear":
        modules = [nn.Linear(96, 2) for _ in range(2)]
    else:
        modules = [nn.Sequential(nn.Linear(96, 8), nn.GELU(), nn.Linear(8, 2)) for _ in range(2)]
    write_surrogate(tmp_path / "surrogate", modules, None if model_type == "linear" else 8)
    method = METHODS["kvzap"](threshold=0.0, window=WINDOW, model_type=model_type, weights=str(tmp_path / "surrogate"))
    assert method.prepare(model, None) == {"kvzap_surrogate": str(tmp_path / "surrogate")}
    out = run(model, method, ids)
    expected = reference(model, ids, lambda i, hidden, keys: modules[i](hidden).T, 0.0)
    assert kept_positions(out.cache) == expected
    assert 0 < sum(len(h) for layer in expected for h in layer) - 2 * 2 * WINDOW < 2 * 2 * (N - WINDOW)


def test_kvzap_loads_only_safetensors_and_refuses_in_one_line(tmp_path):
    model = tiny_model("llama", layers=2)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    torch.save({"layers.0.weight": torch.zeros(2, 96)}, pickled / "pytorch_model.bin")
    write_surrogate(tmp_path / "three", [nn.Linear(96, 2) for _ in range(3)], None)
    cases = [(dict(weights=str(pickled)), "no model.safetensors"),
             (dict(weights="nvidia/KVzap-mlp-Qwen3-8B"), "pin a commit with method.revision"),
             (dict(weights=str(tmp_path / "three"), model_type="linear"), r"\(layers, input, output\) = \(3, 96, 2\)"),
             (dict(model_type="mlp"), "pin a commit")]  # a model without a shipped surrogate: kvpress's Hub id
    for fields, message in cases:
        with pytest.raises(ValueError, match=message) as error:
            METHODS["kvzap"](**fields).prepare(model, None)
        assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="model_type='gru' is not one of linear, mlp"):
        METHODS["kvzap"](model_type="gru")


def test_the_embedded_model_finds_its_shipped_surrogate():
    method = METHODS["kvzap"](model_type="linear")
    folder = method.source("/home/u/.cache/kvbench/models/SmolLM2-135M-Instruct.Q4_1-v0.1.2")
    assert folder.endswith("kvzap_surrogates/SmolLM2-135M-Instruct-linear")
    assert METHODS["kvzap"]().source("Qwen/Qwen3-8B") == "nvidia/KVzap-mlp-Qwen3-8B"
    with pytest.raises(ValueError, match="ships a linear surrogate only"):
        METHODS["kvzap"]().source("SmolLM2-135M-Instruct")


@pytest.mark.parametrize("name", ["dms", "kvzap"])
def test_a_ratio_is_refused_and_a_budget_ignored(name):
    """What a threshold method keeps is an outcome: `ratio=` fails in one line before weights load; any budget runs."""
    from hydra import compose, initialize_config_dir

    from kvbench.runs.config import CONFIG_DIR, setup

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        with pytest.raises(ValueError, match=f"{name}: ratio=0.5 cannot be set") as error:
            setup(compose("config", overrides=["model=tiny_llama", f"method={name}", "ratio=0.5"]))
        assert "\n" not in str(error.value)
        setup(compose("config", overrides=["model=tiny_llama", f"method={name}", "budget=1"]))
