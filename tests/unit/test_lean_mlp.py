"""The capture's in-place gated MLP (`kvbench.models.mlp`): on every family with a gated MLP, a prefill's logits and
every layer's K/V under the capture equal the model's own forward bit for bit (fp32 and bf16); the instance forward
is removed on exit; with autograd on, the class' own forward runs and gradients flow."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvbench.models import AttentionCapture
from kvbench.models.adapters import BY_FAMILY
from kvbench.models.tiny import tiny_random_model

GATED = [family for family, adapter in BY_FAMILY.items() if adapter.mlp is not None]


def forward(model, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    cache = DynamicCache()
    with torch.no_grad():
        logits = model(ids, past_key_values=cache, use_cache=True).logits
    return logits, [t for layer in cache.layers for t in (layer.keys, layer.values)]


def test_every_llama_like_family_has_its_mlp_named():
    assert set(GATED) == {"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", GATED)
def test_prefill_under_the_capture_is_bit_identical(family, dtype):
    model = tiny_random_model(family, layers=2, dtype=dtype)
    ids = torch.randint(0, 256, (2, 97), generator=torch.Generator().manual_seed(1))
    mlps = BY_FAMILY[family].mlp_modules(model)
    assert len(mlps) == 2
    plain_logits, plain_kv = forward(model, ids)
    with AttentionCapture(model, window=8):
        assert all("forward" in m.__dict__ for m in mlps)  # installed on the instances
        logits, kv = forward(model, ids)
    assert not any("forward" in m.__dict__ for m in mlps)  # and gone after
    assert torch.equal(logits, plain_logits)
    assert all(torch.equal(a, b) for a, b in zip(kv, plain_kv))


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_autograd_takes_the_class_forward(family):
    model = tiny_random_model(family, layers=1)
    mlp = BY_FAMILY[family].mlp_modules(model)[0]
    x = torch.randn(1, 5, model.config.hidden_size, requires_grad=True)
    with AttentionCapture(model):
        mlp(x).sum().backward()
    expected = x.grad.clone()
    x.grad = None
    type(mlp).forward(mlp, x).sum().backward()
    assert torch.equal(x.grad, expected)


def test_an_instance_forward_of_its_own_is_left_alone():
    model = tiny_random_model("llama", layers=1)
    mlp = BY_FAMILY["llama"].mlp_modules(model)[0]
    own = mlp.forward = lambda x: type(mlp).forward(mlp, x)  # e.g. accelerate's offload hook
    with AttentionCapture(model):
        assert mlp.__dict__["forward"] is own
    assert mlp.__dict__["forward"] is own


def layer_inputs(model, family: str) -> list[torch.Tensor]:
    """Each decoder layer's input of the next forward, as the layer received it (hooked after the capture's)."""
    seen: list[torch.Tensor] = []
    for mlp in BY_FAMILY[family].mlp_modules(model):
        layer = next(m for m in model.modules() if getattr(m, "mlp", None) is mlp)
        layer.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs.get("hidden_states", args[0])),
                                        with_kwargs=True)
    return seen


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # layer 0's input is the embeddings / a scaled copy
def test_each_layer_input_is_freed_once_read(family):
    model = tiny_random_model(family, layers=2)
    ids = torch.randint(0, 256, (1, 33), generator=torch.Generator().manual_seed(2))
    plain_logits, plain_kv = forward(model, ids)
    with AttentionCapture(model, window=8):
        seen = layer_inputs(model, family)
        logits, kv = forward(model, ids)
        assert len(seen) == 2 and all(t.untyped_storage().nbytes() == 0 for t in seen)
        seen.clear()
        model(ids[:, :1], use_cache=False)  # a decode-sized step keeps its input
        assert len(seen) == 2 and all(t.untyped_storage().nbytes() > 0 for t in seen)
    assert torch.equal(logits, plain_logits)
    assert all(torch.equal(a, b) for a, b in zip(kv, plain_kv))


def test_layer_inputs_someone_else_holds_are_kept():
    model = tiny_random_model("llama", layers=2)
    ids = torch.randint(0, 256, (1, 33), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = model(ids, output_hidden_states=True).hidden_states
    embeds = model.get_input_embeddings()(ids).detach()
    with AttentionCapture(model):
        seen = layer_inputs(model, "llama")
        with torch.no_grad():
            recorded = model(ids, output_hidden_states=True).hidden_states  # every layer input is returned
            model(inputs_embeds=embeds)  # the caller's embeddings stay the caller's
        model(ids)  # autograd records: backward may need them
    assert all(torch.equal(a, b) for a, b in zip(recorded, plain))
    assert torch.equal(embeds, plain[0])
    assert len(seen) == 6 and all(t.untyped_storage().nbytes() > 0 for t in seen)
