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

from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor

from kvbench.cache import KVCache
from kvbench.methods.base import Method

if TYPE_CHECKING:  # as generation.py: importing the engine must not load the capture's attention registries
    from kvbench.models.capture import AttentionCapture


def last_decoder_layer(model, attention: torch.nn.Module) -> torch.nn.Module:
    """The decoder layer holding the last attention module: the element of a ModuleList that contains it (every
    family's layout: `model.layers`, GPT-2's `h`, MPT's `blocks`)."""
    for modules in model.modules():
        if isinstance(modules, torch.nn.ModuleList):
            for layer in modules:
                if any(m is attention for m in layer.modules()):
                    return layer
    raise ValueError(f"kvgrad: cannot find the decoder layer of {type(model).__name__}'s last attention module, "
                     "whose output the gradient objective is defined on")


def output_of(out) -> Tensor:
    return out[0] if isinstance(out, tuple) else out


def reconstruct_with_gradients(model, method: Method, capture: AttentionCapture, cache: KVCache,
                               context_ids: Tensor, scores: dict[int, Tensor], prefill: Callable) -> None:
    """Fill `scores[layer]` `[B, H_kv, n]` chunk by chunk (`method.gradient_scores`); the cache ends as it began.
    `prefill`: the engine's (`generation.prefill`, handed down: the engine's only prefill call site)."""
    n = cache.layers[0].seen_tokens
    seen: dict[int, tuple] = {}
    outputs: dict = {}

    def keep(layer_idx: int, query: Tensor, key: Tensor, scaling: float, softcap: float | None, **_) -> None:
        # (the capture also hands the rows' values and input, which KVzip+ reads)
        if layer_idx in scores:
            seen[layer_idx] = (query.detach(), key.detach(), scaling, softcap)

    hooks = [module.register_forward_hook(lambda m, a, out, i=i: outputs.__setitem__(i, output_of(out)))
             for i, module in capture.attention_modules.items() if i in scores]
    last = capture.attention_modules[max(capture.attention_modules)]
    hooks.append(last_decoder_layer(model, last).register_forward_hook(
        lambda m, a, out: outputs.__setitem__("last", output_of(out))))
    window, capture.window, capture.prefill_hook = capture.window, 0, keep
    embed = model.get_input_embeddings()
    states = cache.states.clone()  # a hybrid's recurrent state cannot drop the input's tokens: restored instead
    try:
        for start, end, ids in method.reconstruction_inputs(context_ids):
            with torch.enable_grad():
                embeds = embed(ids).detach().requires_grad_(True)
                prefill(model, ids, cache, start=n, inputs_embeds=embeds)
                layer_ids = sorted(i for i in outputs if i != "last")
                objective = outputs["last"].float().square().sum()
                grads = torch.autograd.grad(objective, [outputs[i] for i in layer_ids], allow_unused=True)
            outputs.clear()
            for layer in cache.layers:  # drop the input's K/V, and the graph it carried
                layer.truncate(n)
                layer.keys, layer.values = layer.keys.detach(), layer.values.detach()
            cache.states = states.clone()
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
