"""Each decoder layer's input freed inside a prefill forward once the layer has read it for the last time.

A family's model forward holds the running layer's input in a local (and layer 0's is also its embeddings local, alive
for the whole forward), though a sequential block reads it last in the residual add before its MLP: two
`[B, n, hidden]` tensors nothing reads again at a prefill's peak (18 MiB on SmolLM2 at 4k, 2 GiB on Llama-3.1-8B at
128k in bf16). Freeing their storage changes no number; reading a freed tensor is undefined (a segfault), hence the
guards: families whose MLP the capture computes in place (all sequential), no autograd, a forward that embedded its
own `input_ids` and records no hidden states, several positions, not while torch.compile traces.
"""
from __future__ import annotations

import torch
from torch import Tensor


class LayerInputRelease:
    """Hooks on one model instance: the base model's pre-hook decides whether this forward's layer inputs are its
    own and, only then, hooks each decoder layer (which notes its input) and its MLP (which frees it) until the forward
    returns, so a decode step runs one hook, not two per layer."""

    def __init__(self, model: torch.nn.Module, mlps: list[torch.nn.Module]):
        self.model = model
        owners = {id(mlp) for mlp in mlps}
        self.layers = [m for m in model.modules() if id(getattr(m, "mlp", None)) in owners]
        self.pending: dict[int, Tensor] = {}  # id(mlp) -> its layer's input, freed when that MLP starts
        self._handles: list = []
        self._layer_handles: list = []  # during one owned forward

    def install(self) -> None:
        if not self.layers:
            return
        base = self.model.base_model
        self._handles.append(base.register_forward_pre_hook(self._before_model, with_kwargs=True))
        self._handles.append(base.register_forward_hook(self._after_model, always_call=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._after_model()

    def _before_model(self, module, args, kwargs) -> None:
        if torch.compiler.is_compiling():
            return
        self._after_model()  # (a forward that raised may have left its hooks)
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        recording = kwargs.get("output_hidden_states", getattr(module.config, "output_hidden_states", False))
        if (isinstance(input_ids, Tensor) and input_ids.shape[-1] > 1 and kwargs.get("inputs_embeds") is None
                and not recording and not torch.is_grad_enabled()):
            for layer in self.layers:
                self._layer_handles.append(layer.register_forward_pre_hook(self._before_layer, with_kwargs=True))
                self._layer_handles.append(layer.mlp.register_forward_pre_hook(self._before_mlp))

    def _after_model(self, *_) -> None:
        if torch.compiler.is_compiling():
            return
        for handle in self._layer_handles:
            handle.remove()
        self._layer_handles.clear()
        self.pending.clear()

    def _before_layer(self, layer, args, kwargs) -> None:
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if isinstance(hidden, Tensor) and hidden.dim() == 3 and hidden.shape[1] > 1:
            self.pending[id(layer.mlp)] = hidden

    def _before_mlp(self, mlp, args) -> None:
        hidden = self.pending.pop(id(mlp), None)
        if hidden is not None:
            hidden.untyped_storage().resize_(0)
