"""A reconstruction replay with autograd (KVgrad): how much the replay's last hidden states depend on each layer.

`generation.reconstruct` hands a method with `replay_gradient` here. Per reconstruction input (KVzip's chunks) the
model runs forward with autograd on top of the full context cache, from the input's embeddings (so the graph exists
whether or not the weights require gradients; weights never get one: only the activations are differentiated).
Forward hooks record each attention module's output a (what it adds to the residual stream) and the last decoder
layer's output h; the capture's prefill hook keeps each layer's replay queries and keys. Phi = sum ||h||^2 is
differentiated with respect to every a, and the method turns queries, keys, the chunk's values, W_O and
||dPhi / da|| per row into the chunk's scores. The input's K/V is then dropped, as in KVzip's replay.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kvbench.cache import KVCache
from kvbench.methods.base import Method

if TYPE_CHECKING:  # as generation.py: importing the engine must not load the capture's attention registries
    from kvbench.models.capture import AttentionCapture


def last_decoder_layer(model) -> torch.nn.Module:
    layers = getattr(model.get_decoder(), "layers", None)
    if not layers:
        raise ValueError(f"kvgrad: cannot find the decoder layers of {type(model).__name__} (model.get_decoder()"
                         ".layers), whose last output the gradient objective is defined on")
    return layers[-1]


def output_of(out) -> Tensor:
    return out[0] if isinstance(out, tuple) else out


def reconstruct_with_gradients(model, method: Method, capture: AttentionCapture, cache: KVCache,
                               context_ids: Tensor, scores: dict[int, Tensor]) -> None:
    """Fill `scores[layer]` `[B, H_kv, n]` chunk by chunk (`method.gradient_scores`); the cache ends as it began."""
    n = cache.layers[0].seen_tokens
    seen: dict[int, tuple] = {}
    outputs: dict = {}

    def keep(layer_idx: int, query: Tensor, key: Tensor, scaling: float, softcap: float | None) -> None:
        if layer_idx in scores:
            seen[layer_idx] = (query.detach(), key.detach(), scaling, softcap)

    hooks = [module.register_forward_hook(lambda m, a, out, i=i: outputs.__setitem__(i, output_of(out)))
             for i, module in capture.attention_modules.items() if i in scores]
    hooks.append(last_decoder_layer(model).register_forward_hook(
        lambda m, a, out: outputs.__setitem__("last", output_of(out))))
    window, capture.window, capture.prefill_hook = capture.window, 0, keep
    embed = model.get_input_embeddings()
    try:
        for start, end, ids in method.reconstruction_inputs(context_ids):
            with torch.enable_grad():
                embeds = embed(ids).detach().requires_grad_(True)
                pos = torch.arange(n, n + ids.shape[1], device=ids.device)[None]
                model(inputs_embeds=embeds, past_key_values=cache, position_ids=pos, use_cache=True,
                      logits_to_keep=1)
                layer_ids = sorted(i for i in outputs if i != "last")
                objective = outputs["last"].float().square().sum()
                grads = torch.autograd.grad(objective, [outputs[i] for i in layer_ids], allow_unused=True)
            outputs.clear()
            for layer in cache.layers:  # drop the input's K/V, and the graph it carried
                layer.truncate(n)
                layer.keys, layer.values = layer.keys.detach(), layer.values.detach()
            with torch.no_grad():
                for i, grad in zip(layer_ids, grads):
                    query, key, scaling, softcap = seen[i]
                    grad_norm = grad.float().norm(dim=-1) if grad is not None else query.new_zeros(query.shape[::2])
                    values = cache.layers[i].values[:, :, start:end]
                    scores[i][..., start:end] = method.gradient_scores(query, key, scaling, start, end, softcap,
                                                                       grad_norm, values, capture.output_weight(i))
            seen.clear()
    finally:
        capture.window, capture.prefill_hook = window, None
        for hook in hooks:
            hook.remove()
