"""The generic path's query forms (`kvbench.models.query_form`), found at the first prefill from the model's own
queries: TailorKV's predicted query for a new hidden state at a new position equals the query the model's attention
module itself forms from it (per-head norm, whole-projection norm, norm after RoPE, interleaved and complex rotary),
and the layers found to have no rotary are exactly the config's NoPE layers."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvbench.models import AttentionCapture
from kvbench.models.tiny import tiny_random_model
from tests.unit.tiny import attention_function, prompt

_models: dict[str, torch.nn.Module] = {}


def model_of(model_type: str):
    """The tiny model with its norm weights randomised (at init they are ones, and a uniform RMS norm commutes with
    rotation, so a norm before and after RoPE would be indistinguishable, as in no trained checkpoint)."""
    if model_type not in _models:
        model = tiny_random_model(model_type)
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name and param.dim() == 1:
                    param.copy_(1 + 0.5 * torch.randn(param.shape, generator=generator))
        _models[model_type] = model
    return _models[model_type]


def attention_modules(model) -> dict[int, torch.nn.Module]:
    return AttentionCapture(model).attention_modules  # (found from the model, not entered)


def found_forms(model, n: int = 20) -> tuple[AttentionCapture, dict]:
    """The capture after one prefill, and what each layer's input hook saw at one decode step (position n)."""
    seen = {}
    capture = AttentionCapture(model)
    with capture:
        capture.input_hook = lambda i, hidden, pos: seen.setdefault(i, (hidden, pos))
        with torch.no_grad():
            cache = DynamicCache()
            model(prompt(n), past_key_values=cache, use_cache=True)
            model(prompt(1, seed=5), past_key_values=cache, position_ids=torch.tensor([[n]]), use_cache=True)
        forms = dict(capture.query_forms)
        predicted = {i: capture.predict_query(i, *seen[i]) for i, form in forms.items() if form is not None}
    return forms, predicted, seen


@pytest.mark.parametrize("model_type,norm", [("qwen3_moe", "head"), ("olmo3", "projection"),
                                             ("hunyuan_v1_dense", "after rope"), ("ernie4_5", None),
                                             ("cohere", None), ("llama4_text", None), ("glm4", None)])
def test_predicted_query_is_the_layers_own_query(model_type, norm):
    model = model_of(model_type)
    forms, predicted, seen = found_forms(model)
    if model_type == "llama4_text":  # position-scaled NoPE queries: no form is trusted, q-hat refuses
        assert set(forms.values()) == {None}
        return
    if norm is not None:
        form = forms[0]
        assert form.norm is not None and (form.norm_after_rope if norm == "after rope" else form.norm_over == norm)
    for i, query in predicted.items():  # the module's own query for the same input at the same position
        grabbed = {}

        def grab(module, q, k, v, mask, **kw):
            grabbed["q"] = q
            return torch.zeros(q.shape[0], q.shape[2], q.shape[1], q.shape[3]), None

        hidden, position_embeddings = seen[i]
        with attention_function(model, grab):
            attention_modules(model)[i](hidden_states=hidden, position_embeddings=position_embeddings,
                                                 attention_mask=None)
        torch.testing.assert_close(query, grabbed["q"])


@pytest.mark.parametrize("model_type", ["smollm3", "exaone4", "llama4_text"])
def test_nope_layers_found_are_the_configs(model_type):
    """SmolLM3 (`no_rope_layers`), EXAONE 4 (global layers without RoPE), Llama 4 (`no_rope_layers`): the layers whose
    queries reproduce without any rotation are exactly the config's NoPE layers (Llama 4: found before its query
    temperature makes the capture distrust the form)."""
    from kvbench.models.query_form import discover

    model = model_of(model_type)
    config = model.config
    if hasattr(config, "no_rope_layers"):
        expected = {i for i, rope in enumerate(config.no_rope_layers) if not rope}
    else:  # EXAONE 4: sliding layers rotate, global layers do not
        expected = {i for i, kind in enumerate(config.layer_types) if kind == "full_attention"}
    inputs, found = {}, {}

    def before(module, args, kwargs):
        inputs[module.layer_idx] = (kwargs["hidden_states"][:, -1:], kwargs["position_embeddings"])

    def record(module, q, k, v, mask, **kw):
        hidden, pos = inputs[module.layer_idx]
        last = pos[:, -1:] if isinstance(pos, torch.Tensor) else tuple(t[:, -1:] for t in pos)
        found[module.layer_idx] = discover(module, hidden, last, q[:, :, -1:])
        return torch.zeros(q.shape[0], q.shape[2], q.shape[1], q.shape[3]), None

    attentions = list(attention_modules(model).values())
    handles = [a.register_forward_pre_hook(before, with_kwargs=True) for a in attentions]
    try:
        with attention_function(model, record):
            model(prompt(20))
    finally:
        for handle in handles:
            handle.remove()
    assert expected and {i for i, form in found.items() if form is not None and form.rotation == "none"} == expected
    assert all(form is not None for form in found.values())
