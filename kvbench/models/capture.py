"""Per-model-instance attention capture, as a context manager.

`with AttentionCapture(model, window=32) as capture:` registers a uniquely named attention function that wraps the
model's own implementation (sdpa or eager), points *this* model at it, and restores the model on exit. Nothing global
is patched: another model in the same process keeps its attention untouched.

What it records at prefill, per layer: the last `window` post-RoPE queries `[B, H_q, w, D]` and the softmax scale,
and once per layer (a model constant, kept across samples) its rotary angles (`rotary`, `kvbench.models.rotary`), so
a scorer can rotate queries back or forward (Expected Attention).
That is all SnapKV-style scoring needs, so the n x n attention matrix is never built. For accumulated-attention
policies (H2O, Keyformer, BUZZ) it also computes, when `column_score` is given, the column sums of a row-wise score
of the causal prefill logits, `[B, H_q, n]`, in chunks of query rows (memory chunk x n, never n x n); a grid sweep
adds named scorers (`column_scores`, sums in `named_column_sums`) that share each chunk's logits. During decoding, `decode_hook(layer_idx, query, key, scaling)` runs after each layer's attention, so a policy can score the
new query over the cache and evict before the next step, and `input_hook(layer_idx, hidden, position_embeddings)`
runs before each layer's attention with that layer's (post-norm) input, so an offloading cache can prefetch for the
next layer (`predict_query` turns that input into the next layer's query, TailorKV's q̂).
`prefill_hook(layer_idx, query, key, scaling, softcap, value=, hidden=)` runs at each prefill attention (several
rows, dense cache) with the rows' post-RoPE queries `[B, H_q, q, D]`, every key and value the rows attend
`[B, H_kv, n + q, D]` and the rows' attention input `[B, q, hidden]`: KVzip scores the context by the attention its
reconstruction's rows pay it (`generation.reconstruct`; KVzip+ weighs it by the input's norm and ‖v W_o‖).
`input_scorer(layer_idx, hidden)` runs before each prefill attention with the layer's (post-norm) input
`[B, n, hidden]`, and its per-entry scores `[B, H_kv, n]` wait in `input_scores` for the layer's selection (KVzap's
surrogate scores the hidden states; the input itself is not kept); a grid sweep adds named input scorers
(`input_scorers`, scores in `named_input_scores`), one per configuration that scores inputs.

At decode, a layer with its own storage (Ada-KV, TailorKV: `layer.own_storage`) is attended by the engine's decode
attention (`kvbench.attention.decode`), with the model's soft cap and, for MPT, its ALiBi slopes.

Attention modules, the family's eager kernel, predicted queries and window layers come from the model family's
adapter (`kvbench.models.adapters`), never from attribute names; an unsupported family is refused there.

While active it also computes the family's gated MLP in place on each instance (`kvbench.models.mlp`: one
`[B, n, intermediate]` tensor fewer at a prefill's peak, the same output bit for bit), and frees each decoder layer's
input once the layer has read it for the last time (`kvbench.models.release`).

The wrapper also lets a layer hold one KV copy per query head (the paper-era `query_head` layout): the wrapped
function then sees as many key heads as query heads and is told not to repeat them.
"""
from __future__ import annotations

import itertools
from contextlib import nullcontext
from types import SimpleNamespace
from typing import Callable

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvbench.attention.columns import causal_column_sums
from kvbench.attention.decode import attend, chunk_attention
from kvbench.attention.sinks import sinks_of
from kvbench.cache.kv_cache import DecodeKV
from kvbench.models.adapters import adapter_for
from kvbench.models.mla import absorb_query, latent_keys, latent_layers, with_sparse_indices
from kvbench.models.mlp import lean_mlp_forward
from kvbench.models.generic import layer_windows
from kvbench.models.placement import execution_device, offloads_weights, weights_present
from kvbench.models.release import LayerInputRelease
from kvbench.models.query_form import QueryForm, discover, last_rows, rotary_of, to_device
from kvbench.models.rotary import Rotary

_ids = itertools.count()
RECURRENT_LAYER_TYPES = frozenset({"linear_attention", "conv", "mamba", "hybrid", "hybrid_sliding"})


def is_hybrid(config, n_attention_layers: int) -> bool:
    """Whether a model has layers that keep a recurrent state (linear attention, SSM, short conv) or no cache at
    all (MLP-only) beside its attention layers: found from its layer types and attention modules, not listed."""
    types = set(getattr(config, "layer_types", None) or ())
    return bool(types & RECURRENT_LAYER_TYPES) or n_attention_layers < config.num_hidden_layers


def hand_cache_over(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook on a base model that takes no cache but its own class while `use_cache` is set (MiniMax's
    `MiniMaxCache`): there the flag only makes or checks the cache, and its layers use whatever cache is handed over,
    so kvbench's is handed over with the flag off."""
    if kwargs.get("past_key_values") is not None and kwargs.get("use_cache"):
        return args, {**kwargs, "use_cache": False}
    return None


class AttentionCapture:
    """Records window queries at prefill for one model instance; see the module docstring."""

    def __init__(self, model: torch.nn.Module, window: int = 0,
                 decode_hook: Callable[[int, Tensor, Tensor, float], None] | None = None,
                 column_score: Callable[[Tensor], Tensor] | None = None, chunk: int = 512,
                 input_hook: Callable[[int, Tensor, tuple[Tensor, Tensor]], None] | None = None):
        self.model = model
        self.window = window
        self.question_len = 0  # the prompt's last tokens that are its question (FINCH's window; set by prepare)
        self.decode_hook = decode_hook
        self.column_score = column_score  # masked fp32 logits [B, H_q, c, n] -> row scores (e.g. softmax)
        self.column_block: int | None = None  # w: mask only the trailing w x w block (KVCache-Factory's H2O)
        self.logit_scale: Callable[[int], float] | None = None  # n_keys -> factor on every logit (BUZZ log n)
        self.chunk = chunk
        self.input_hook = input_hook
        self.prefill_hook: Callable[..., None] | None = None  # see module doc
        self.input_scorer: Callable[[int, Tensor], Tensor] | None = None  # see module doc
        self.input_scores: dict[int, Tensor] = {}  # what `input_scorer` gave each layer's prefill, `[B, H_kv, n]`
        self.input_scorers: dict[str, Callable[[int, Tensor], Tensor]] = {}  # more named ones, one prefill (grid)
        self.named_input_scores: dict[str, dict[int, Tensor]] = {}  # their scores, by name then layer
        self._prefill_inputs: dict[int, Tensor] = {}  # each layer's attention input, held for `prefill_hook`
        self.window_queries: dict[int, Tensor] = {}
        self.decode_window = 0  # > 0: the sequence's last queries a decode-time compressor starts from (R-KV's query
        # cache), held per layer in `decode_queries` from the prefill and fed chunks; set and taken by `prepare`,
        # which is why `reset` (called by `compress`, before a fed question) keeps them
        self.decode_queries: dict[int, Tensor] = {}
        self.window_bias: dict[int, Tensor] = {}  # additive score bias of the window rows (ALiBi), `[B, H, w, n]`
        self.softcap: dict[int, float] = {}  # attention-logit soft cap per layer (Gemma 2), as the model applies it
        self.sinks: dict[int, Tensor] = {}  # learned sink logits `[H_q]` per layer (gpt-oss's `s_aux`), from each
        # call: a model constant, so `reset` keeps them; every softmax kvbench computes for the layer includes them
        self.column_sums: dict[int, Tensor] = {}
        self.key_scores: dict[int, Tensor] = {}  # per-entry scores a reconstruction left, `[B, H_kv, n]` (KVzip)
        self.column_scores: dict[str, Callable[[Tensor], Tensor]] = {}  # more named scorers, one prefill (grid)
        self.named_column_sums: dict[str, dict[int, Tensor]] = {}  # their column sums, by name then layer
        self.scaling: dict[int, float] = {}
        self.rotary: dict[int, Rotary] = {}  # each layer's position encoding, read at its first prefill; a model
        # constant, so `reset` keeps it (Expected Attention rotates query statistics with it)
        self.cache = None  # set by `generation.compress`: lets decode attention find per-head variable layers
        self.name = f"kvbench_capture_{next(_ids)}"
        self._original: str | None = None
        self.adapter = adapter_for(model)
        self.attention_modules = self.adapter.attention_modules(model)  # by cache slot (`KVCache.slot_of`)
        self.slots = {layer: slot for slot, layer in self.adapter.layer_numbers(model).items()}  # model layer -> slot
        self._numbers = {slot: m.layer_idx for slot, m in self.attention_modules.items()}  # (restored on exit)
        self.window_layers = frozenset(self.slots[i] for i in self.adapter.window_layers(model.config)
                                       if i in self.slots)  # methods leave these layers as they are
        self.hybrid = is_hybrid(model.config.get_text_config(), len(self.attention_modules))  # (`cache.hybrid`)
        self.latent_layers = latent_layers(self.attention_modules)  # MLA slots: one latent per token (`models.mla`)
        self._latent_cache = None  # the cache an MLA layer's forward writes its latents into (its kwargs)
        self.layer_windows: dict[int, tuple[str, int]] = {self.slots[i]: w for i, w in layer_windows(
            model.config).items() if i in self.slots} if self.adapter.generic else {}
        # {slot: (sliding_attention | chunked_attention, size)} of a generic model (a hand-written family's window
        # is its attention module's `sliding_window`)
        self.query_forms: dict[int, QueryForm | None] = {}  # generic: each layer's query form, found at its first
        # prefill (`models.query_form`); a model constant, so `reset` keeps it
        self._form_inputs: dict[int, tuple] = {}  # the first prefill's last input row and position encoding
        self._handles: list = []
        self._lean_mlps: list[torch.nn.Module] = []
        self._release: LayerInputRelease | None = None
        self._placement: dict[int, tuple[torch.device, bool]] = {}  # layer -> (device, weights offloaded): fixed
        # once loaded, so found once (walking the module tree on every predicted query cost ~3 % of a batched step)

    def reset(self) -> None:
        """Forget what the previous prompt left behind (call between samples)."""
        self.window_queries.clear()
        self.window_bias.clear()
        self.question_len = 0
        self.column_sums.clear()
        self.key_scores = {}
        self.input_scores = {}
        self.input_scorers = {}
        self.named_input_scores = {}
        self._prefill_inputs = {}
        self.column_scores = {}
        self.named_column_sums = {}
        self.scaling.clear()
        self._form_inputs = {}
        self.cache = None
        self.decode_hook = None  # per-sample hooks are set again by the next sample's `generate`
        self.column_score = None
        self.column_block = None
        self.input_hook = None
        self.prefill_hook = None
        self.input_scorer = None

    # --- context manager --------------------------------------------------------------------------------------
    def __enter__(self) -> "AttentionCapture":
        self._original = self.model.config._attn_implementation
        inner = ALL_ATTENTION_FUNCTIONS.get_interface(self._original, self.adapter.eager_function())
        attention = self._wrap(inner)
        AttentionInterface.register(self.name, attention)
        mask_fn = ALL_MASK_ATTENTION_FUNCTIONS.get(self._original, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
        AttentionMaskInterface.register(self.name, mask_fn)
        if self.adapter.replaces is None:  # the interface routes attention: point this model at the wrapper
            self.model.set_attn_implementation(self.name)
        for layer, slot in self.slots.items():  # (Zamba's blocks get their layer's number while attached)
            self.attention_modules[slot].layer_idx = layer
        for module in self.attention_modules.values():
            self._handles.append(module.register_forward_pre_hook(self._before_attention, with_kwargs=True))
            if self.adapter.replaces is not None:  # attention that bypasses the interface: this instance only
                name, factory = self.adapter.replaces
                setattr(module, name, factory(module, attention))
        if self.adapter.own_cache:
            self._handles.append(self.model.base_model.register_forward_pre_hook(hand_cache_over, with_kwargs=True))
        for module in self.adapter.mlp_modules(self.model):
            if "forward" not in module.__dict__:  # (an instance forward of its own, e.g. accelerate's hook, stays)
                module.forward = lean_mlp_forward(module, self.adapter.mlp_layout)
                self._lean_mlps.append(module)
        self._release = LayerInputRelease(self.model, self._lean_mlps)
        self._release.install()
        return self

    def __exit__(self, *exc) -> None:
        if self.adapter.replaces is None:
            self.model.set_attn_implementation(self._original)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for slot, module in self.attention_modules.items():
            module.layer_idx = self._numbers[slot]
            if self.adapter.replaces is not None:
                module.__dict__.pop(self.adapter.replaces[0], None)  # back to the class' own method
        for module in self._lean_mlps:
            module.__dict__.pop("forward", None)
        self._lean_mlps.clear()
        self._release.remove()
        AttentionInterface._global_mapping.pop(self.name, None)
        AttentionMaskInterface._global_mapping.pop(self.name, None)
        self.reset()

    # --- before each attention module ------------------------------------------------------------------------------
    def _before_attention(self, module, args, kwargs) -> None:
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        slot = self.slots[module.layer_idx]
        prefill = hidden is not None and hidden.shape[1] > 1
        if slot in self.latent_layers:  # its call sees expanded K/V; scores need the latents
            self._latent_cache = kwargs.get("past_key_values")
            # (an MLA layer's rotary part is not a head's: no query form or rotary recorded)
        elif self.adapter.generic and prefill and slot not in self.query_forms:
            # found once the attention function sees this row's query
            self._form_inputs[slot] = (hidden[:, -1:], kwargs.get("position_embeddings"))
        elif prefill and slot not in self.rotary:
            self._record_rotary(module, kwargs)
        if hidden is not None and hidden.shape[1] > 1:  # a prefill (or a chunk): scorers of the layer's input
            if self.prefill_hook is not None:
                self._prefill_inputs[slot] = hidden
            if self.input_scorer is not None:
                self.input_scores[slot] = self.input_scorer(slot, hidden)
            for name, scorer in self.input_scorers.items():
                self.named_input_scores.setdefault(name, {})[slot] = scorer(slot, hidden)
        if self.input_hook is not None and hidden is not None and hidden.shape[1] == 1:
            self.input_hook(slot, hidden, self.adapter.position_embeddings(module, kwargs))

    def _record_rotary(self, module, kwargs) -> None:
        """The layer's rotary angles from the (cos, sin) its prefill rotates with (none for learned/ALiBi)."""
        if self.adapter.positions != "rope":
            self.rotary[self.slots[module.layer_idx]] = Rotary.none()
            return
        embeddings = self.adapter.position_embeddings(module, kwargs) if (
            "position_ids" in kwargs or self.adapter.rotary_layout == "half") else None
        if embeddings is not None:  # (absent: a method that needs it says so)
            self.rotary[self.slots[module.layer_idx]] = Rotary.from_embeddings(*embeddings,
                                                                               self.adapter.rotary_layout)

    def _find_query_form(self, module, query: Tensor) -> None:
        """Generic path: the layer's query form (and from it its rotary angles) from its first prefill's last row."""
        slot = self.slots[module.layer_idx]
        hidden, position_embeddings = self._form_inputs.pop(slot)
        form = discover(module, hidden, last_rows(position_embeddings, 1), query[:, :, -1:])
        if self.adapter.query_temperature:  # scaled by position only past a threshold: a short prompt hides it
            form = None
        self.query_forms[slot] = form
        rotary = rotary_of(form, position_embeddings)
        if rotary is not None:
            self.rotary[slot] = rotary

    def output_weight(self, layer_idx: int) -> Tensor | None:
        """The layer's attention output projection `[hidden, H_q * D]` (W_o; `Adapter.output_weight`), or None."""
        module = self.attention_modules.get(layer_idx)
        return None if module is None else self.adapter.output_weight(module)

    def can_predict(self, layer_idx: int) -> bool:
        """Whether `predict_query(layer_idx, ...)` is exact up to the input: the layer before feeds the same position
        encoding (Gemma 3's window and global layers rotate with different frequencies)."""
        types = getattr(self.model.config, "layer_types", None)
        if not self.adapter.query_predictable:  # (ZAYA, Zamba: `Adapter.query_predictable`)
            return False
        if layer_idx not in self.attention_modules or layer_idx - 1 not in self.attention_modules:
            return False
        if self.adapter.generic and not (self.query_forms.get(layer_idx) and self.query_forms.get(layer_idx - 1)):
            return False  # (a form kvbench could not reproduce: `predict_query` refuses)
        this, before = (self.attention_modules[i].layer_idx for i in (layer_idx, layer_idx - 1))
        return not types or types[this] == types[before]

    @torch.no_grad()
    def predict_query(self, layer_idx: int, hidden: Tensor,
                      position_embeddings: tuple[Tensor, Tensor] | None) -> Tensor:
        """Layer `layer_idx`'s query projection (the query slice of a fused QKV weight), per-head norm and position
        encoding applied to another layer's input `[B, 1, hidden]`: `[B, H_q, 1, D]`. TailorKV feeds it the
        previous layer's post-norm input (residual streams change slowly)."""
        module = self.attention_modules[layer_idx]
        if not self.adapter.query_predictable:
            raise NotImplementedError(f"capture: {self.adapter.family}'s queries cannot be predicted from another "
                                      "layer's input (ZAYA's read a conv state, Zamba's join the embeddings), so no "
                                      "q-hat is available; use method.channel_query=current, or another method")
        if self.adapter.generic:
            return self._predict_generic(layer_idx, module, hidden, position_embeddings)
        if layer_idx not in self._placement:
            self._placement[layer_idx] = execution_device(module), offloads_weights(module)
        device, offloaded = self._placement[layer_idx]
        # with a device map the previous layer may sit on another device: compute where this layer lives
        hidden, *position_embeddings = (t.to(device) for t in (hidden, *(position_embeddings or ())))
        with weights_present(module) if offloaded else nullcontext():  # offloaded weights are meta until loaded
            query = self.adapter.project_query(module, hidden)
        return self.adapter.position_query(query, tuple(position_embeddings) or None)

    def _predict_generic(self, layer_idx: int, module, hidden: Tensor, position_embeddings) -> Tensor:
        form = self.query_forms.get(layer_idx)
        if form is None:
            raise NotImplementedError(
                f"capture: layer {layer_idx} of {self.adapter.family} forms its queries in a way kvbench could not "
                "reproduce from its projection, norm and rotary (e.g. Llama 4's temperature-scaled NoPE queries, a "
                "fused or gated projection), so a predicted query (TailorKV's q-hat) is unavailable; use another "
                "method")
        if layer_idx not in self._placement:
            self._placement[layer_idx] = execution_device(module), offloads_weights(module)
        device, offloaded = self._placement[layer_idx]
        with weights_present(module) if offloaded else nullcontext():
            return form.query(module, hidden.to(device), to_device(position_embeddings, device))

    # --- the attention function -------------------------------------------------------------------------------
    def _wrap(self, inner: Callable) -> Callable:
        def attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, **kwargs):
            layer_idx = self.slots[module.layer_idx]
            q_len = query.shape[2]
            if q_len > 1 and layer_idx in self._form_inputs:
                self._find_query_form(module, query)
            scaling = kwargs.get("scaling") or module.scaling
            score_bias = kwargs.pop("score_bias", None)  # rows -> additive bias [B, H, rows, n] (ALiBi), or None
            alibi_slopes = kwargs.pop("alibi_slopes", None)  # [H_q]: the same ALiBi, for layers with own storage
            softcap = kwargs.get("softcap")
            indices = kwargs.pop("indices", None)  # DSA: the keys the model's indexer chose (`with_sparse_indices`)
            sinks = sinks_of(kwargs)
            if sinks is not None:
                self.sinks[layer_idx] = sinks
            if self.logit_scale is not None:  # a temperature on the model's own attention, scores included
                scaling = kwargs["scaling"] = scaling * self.logit_scale(key.shape[-2])
            layer = self.cache.layers[layer_idx] if self.cache is not None and q_len > 1 else None
            if layer is not None and (getattr(layer, "own_storage", False) or key.shape[-2] > q_len):
                if indices is not None:
                    raise NotImplementedError("capture: several tokens on top of a compressed cache (query=agnostic, "
                                              "turns) on a DSA model: kvbench's chunk attention does not apply the "
                                              "indexer's top-k; use query=aware")
                out = self._chunk(layer, query, key, value, scaling, softcap, score_bias, alibi_slopes, kwargs,
                                  sinks)
                self._hold_decode_queries(layer_idx, query)
                if hasattr(self.decode_hook, "chunk"):  # a decode-time evictor scores the chunk's rows, evicts
                    self.decode_hook.chunk(layer_idx, query, key, scaling)
                return out, None
            if q_len > 1:  # prefill: keep only what scoring needs
                scored = self._latent_query(module, query)  # what scores multiply with the stored keys
                if self.prefill_hook is not None:  # a scorer of these rows over every key (KVzip's reconstruction)
                    if score_bias is not None:
                        raise NotImplementedError("capture: reconstruction scoring (kvzip) does not support ALiBi")
                    rows_key, rows_value = (key, value) if scored is query else self.view_kv(
                        layer_idx, self._latent_cache.layers[layer_idx])
                    self.prefill_hook(layer_idx, scored, rows_key, scaling, softcap, value=rows_value,
                                      hidden=self._prefill_inputs.pop(layer_idx, None))
                if kwargs.get("sliding_window"):  # scores see only what each query's window lets it see
                    score_bias = window_bias(score_bias, kwargs["sliding_window"], key.shape[-2], key.device)
                self.scaling[layer_idx] = scaling
                if softcap is not None:
                    self.softcap[layer_idx] = softcap
                self._hold_decode_queries(layer_idx, query)
                if self.window:
                    self.window_queries[layer_idx] = scored[:, :, -self.window:].detach().clone()
                    if score_bias is not None:
                        self.window_bias[layer_idx] = score_bias(slice(max(q_len - self.window, 0), q_len))
                scorers = dict(self.column_scores)
                if self.column_score is not None:  # the run's own method
                    scorers[None] = self.column_score
                if scorers:
                    sums = self._column_sums(query, key, scaling, scorers, score_bias, softcap, sinks)
                    if None in sums:
                        self.column_sums[layer_idx] = sums.pop(None)
                    for name, total in sums.items():
                        self.named_column_sums.setdefault(name, {})[layer_idx] = total
            else:
                window_mask = self._window_mask(layer_idx, key, query.shape[1], kwargs.get("sliding_window"))
                if window_mask is None and layer_idx in self.layer_windows:  # generic: from the layer's kind
                    kind, size = self.layer_windows[layer_idx]
                    window_mask = self._window_mask(layer_idx, key, query.shape[1], size, kind)
                if window_mask is not None or (attention_mask is not None
                                               and attention_mask.shape[-1] != key.shape[-2]):
                    # (see `_window_mask`; a mask sized for another layer is dropped)
                    attention_mask = window_mask if window_mask is not None and window_mask.numel() else None
            if indices is not None:  # (after the decode branch above, which may replace the model's mask)
                attention_mask = with_sparse_indices(attention_mask, indices, key.shape[-2], query.dtype)
            if q_len == 1 and self.decode_hook is not None:
                out = inner(module, query, key, value, attention_mask, **kwargs)
                bias = score_bias(slice(0, 1)) if score_bias is not None else None
                if window_mask is not None and window_mask.numel():  # scores see only the window, like attention
                    bias = window_mask if bias is None else bias + window_mask
                self.decode_hook(layer_idx, query, key, scaling, **({} if bias is None else {"bias": bias}))
                # (the hook may evict: this step already attended)
                return out
            if q_len == 1:
                layer = self.cache.layers[layer_idx] if self.cache is not None else None
                if getattr(layer, "own_storage", False):  # varlen, quantized, offloaded: the engine's attention
                    refuse_window(layer, kwargs.get("sliding_window"))
                    return attend(layer, query, scaling, softcap=softcap, alibi_slopes=alibi_slopes,
                                  sinks=sinks), None
            if key.shape[1] == query.shape[1] and getattr(module, "num_key_value_groups", 1) > 1:
                # the cache already holds one copy per query head: tell the kernel not to repeat
                module = SimpleNamespace(num_key_value_groups=1, is_causal=getattr(module, "is_causal", True),
                                         layer_idx=layer_idx, scaling=module.scaling, training=module.training,
                                         sinks=getattr(module, "sinks", None))  # (gpt-oss's kernel reads them)
            return inner(module, query, key, value, attention_mask, **kwargs)

        return attention

    def _latent_query(self, module, query: Tensor) -> Tensor:
        """The queries scores use: as the call sees them, or absorbed into an MLA layer's latent space."""
        return absorb_query(module, query) if self.slots[module.layer_idx] in self.latent_layers else query

    def view_kv(self, layer_idx: int, layer) -> tuple[Tensor, Tensor]:
        """The keys and values a method scores a layer's entries with (`LayerView`): the stored ones, or for an MLA
        layer its one latent key head `[c_kv, k_rope]` and the latent `c_kv` its values are expanded from."""
        if layer_idx in self.latent_layers:
            return latent_keys(layer.keys, layer.values), layer.keys
        return layer.keys, layer.values

    @staticmethod
    def _chunk(layer, query: Tensor, key: Tensor, value: Tensor, scaling: float, softcap: float | None, score_bias,
               alibi_slopes, kwargs: dict, sinks: Tensor | None = None) -> Tensor:
        """Several tokens on top of this layer's (compressed) entries (`generation.feed`): the model's mask is sized
        for the first layer only, and a layer with its own storage returns only its dense part from `update`, so
        the layer is attended here as it is (`attention.decode.chunk_attention`)."""
        if kwargs.get("sliding_window") or score_bias is not None or alibi_slopes is not None:
            raise NotImplementedError("capture: several tokens on top of a compressed cache (query=agnostic, turns) "
                                      "are not supported with sliding-window or ALiBi attention")
        kv = layer.decode_kv(query) if getattr(layer, "own_storage", False) else DecodeKV(key, value)
        return chunk_attention(query, kv, scaling, softcap, sinks)

    def _hold_decode_queries(self, layer_idx: int, query: Tensor) -> None:
        """The sequence's last `decode_window` queries so far, across the prefill and fed chunks."""
        if self.decode_window:
            held = self.decode_queries.get(layer_idx)
            queries = query if held is None else torch.cat([held, query], dim=2)
            self.decode_queries[layer_idx] = queries[:, :, -self.decode_window:].detach().clone()

    def trim_window_layers(self, cache) -> None:
        """After prefill a sliding-window layer keeps only the entries the next token can still see, the last
        `window - 1` (transformers' own sliding cache keeps as many); at decode the window is then applied by each
        entry's position (`_decode_mask`), so tokens that leave it are masked, and the layer grows by one per step."""
        for i in self.window_layers:
            layer, window = cache.layers[i], getattr(self.attention_modules.get(i), "sliding_window", None)
            if i in self.layer_windows:  # generic (a chunk of C keeps the last C - 1 too: its own chunk is in them)
                window = self.layer_windows[i][1]
            n = layer.keys.shape[-2] if getattr(layer, "keys", None) is not None else 0
            if window and n > window - 1:
                b, h = layer.keys.shape[:2]
                layer.keep(torch.arange(n - window + 1, n, device=layer.keys.device).expand(b, h, window - 1))

    def _window_mask(self, layer_idx: int, key: Tensor, n_heads: int, window: int | None,
                     kind: str = "sliding_attention") -> Tensor | None:
        """A sliding window (or, for `kind` chunked_attention, Llama 4's chunk: a query sees the keys of its own chunk
        of `window` positions) applied to one new token by each kept key's position, not its slot (after eviction or
        trimming the model's own window mask would count slots): `[B, H_q, 1, k]` additive, an empty tensor when
        every key is inside (no mask needed at batch 1), None when the layer has no window or no positions.
        Otherwise the model's mask stays, unless it is sized for another layer (layers keep different lengths, and
        one token at batch 1 sees all of its layer)."""
        layer = self.cache.layers[layer_idx] if self.cache is not None and window else None
        positions = layer.attention_positions() if hasattr(layer, "attention_positions") else None
        if positions is None or positions.shape[-1] != key.shape[-2]:
            return None
        if kind == "chunked_attention":
            outside = positions // window != positions[..., -1:] // window  # [B, H_stored, k]; newest = the query
        else:
            outside = positions <= positions[..., -1:] - window  # [B, H_stored, k]; the newest entry is the query
        if not bool(outside.any()):
            return key.new_zeros(0)
        outside = outside.repeat_interleave(n_heads // outside.shape[1], dim=1)[:, :, None]  # [B, H_q, 1, k]
        return torch.zeros(outside.shape, dtype=key.dtype, device=key.device).masked_fill(outside, float("-inf"))

    def _column_sums(self, query: Tensor, key: Tensor, scaling: float, scorers: dict, score_bias=None,
                     softcap: float | None = None, sinks: Tensor | None = None) -> dict:
        """Sum over the n prompt queries of each `scorer(causal logits)`: `[B, H_q, n]`, fp32, chunked by rows
        (`attention.columns.causal_column_sums`, the helper fed chunks are scored with too). The logits are shaped as
        the model shapes them: `softcap` (Gemma 2), then `score_bias(rows)` (ALiBi)."""
        return causal_column_sums(query, key, scaling, scorers, softcap=softcap, score_bias=score_bias,
                                  block=self.column_block, chunk=self.chunk, sinks=sinks)


def refuse_window(layer, window: int | None) -> None:
    """A layer with its own storage may hold keys the model's sliding window hides, which it does not mask."""
    if window and layer.seen_tokens > window:
        raise NotImplementedError(f"capture: a layer with its own storage cannot apply the model's sliding window "
                                  f"({window}) to a {layer.seen_tokens}-token context; use a dense method (snapkv, "
                                  "pyramidkv, streamingllm, h2o, ...)")


def window_bias(score_bias, window: int, n_keys: int, device) -> Callable:
    """`score_bias` (rows -> `[B, H, rows, n]` or None) plus -inf where a prompt key lies outside the row's sliding
    window (key <= row - window), as `[1, 1, rows, n]`: what a uniform-window layer (Mistral v0.1) really sees."""

    def bias(rows: slice) -> Tensor:
        q = torch.arange(rows.start, rows.stop, device=device)[:, None]
        outside = torch.arange(n_keys, device=device)[None, :] <= q - window
        extra = torch.zeros(outside.shape, device=device).masked_fill(outside, float("-inf"))[None, None]
        return extra if score_bias is None else score_bias(rows) + extra

    return bias
