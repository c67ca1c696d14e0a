"""prefill -> compress, as free functions with explicit positions (gpt-fast style), and what decoding needs.

Prefill runs full attention over the whole prompt (so the first generated token equals the full cache's), the
method then drops entries from the cache; the engine's step (`kvbench.engine.batching`) then appends one token at a
time, for one sample or many. The t-th generated token gets position `prompt_len + t`, never the cache length: kept
keys keep their original RoPE positions. No Hydra, no files: `kvbench.runs` owns those.
"""
from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kvbench.attention.decode import without_cudnn_attention
from kvbench.engine import layerwise
from kvbench.engine.gradient_replay import reconstruct_with_gradients
from kvbench.engine.recompress import (DecodeCompression, Recompressor, hold_decode_queries, select,
                                       take_decode_queries)
from kvbench.cache import KVCache
from kvbench.cache.channels import ChannelPrunedLayer
from kvbench.cache.ledger import TransferLedger
from kvbench.cache.rerotate import model_inv_freq
from kvbench.cache.varlen import VarlenLayer
from kvbench.methods.base import Kind, LayerView, Method
from kvbench.methods.contract import check_selection, layer_budgets, name_of
from kvbench.methods.decoding import EvictionState
from kvbench.methods.latent import as_latent_selection, check_latent

if TYPE_CHECKING:  # annotations only: the config checks import Sampling without transformers' attention registries
    from kvbench.models.capture import AttentionCapture


@dataclass
class Sampling:
    """Greedy by default; `do_sample=True` samples with temperature / top-k / top-p from a seeded generator."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    num_beams: int = 1  # > 1: beam search over the compressed cache (kvbench.engine.beam), greedy scores only
    length_penalty: float = 1.0  # beam search: finished score = sum log p / generated_len ** length_penalty
    early_stopping: bool = False  # beam search: stop once num_beams hypotheses are finished (Keyformer: true)

    def __post_init__(self):
        if self.num_beams < 1:
            raise ValueError(f"generation: num_beams={self.num_beams} must be >= 1 (1 = no beam search)")
        if self.num_beams > 1 and self.do_sample:
            raise ValueError(f"generation: num_beams={self.num_beams} is beam search, which is greedy here; set "
                             "generation.do_sample=false or generation.num_beams=1")


@dataclass
class Generation:
    token_ids: list[int]
    text: str
    prompt_len: int
    kv_bytes: int  # after compression, before decoding
    full_kv_bytes: int  # what the uncompressed prompt cache held
    kv_bytes_final: int
    kept_per_head: list[list[int]]
    timings: dict[str, float] = field(default_factory=dict)
    kv_bytes_per_layer: list[int] = field(default_factory=list)  # device-resident, after compression
    kv_bytes_per_layer_final: list[int] = field(default_factory=list)  # and at the end of decoding
    host_kv_bytes: int = 0  # offloaded to host memory (TailorKV's sparse layers)
    transfers: dict | None = None  # the byte ledger's summary, for offloading methods
    peak_kv_bytes: int = 0  # the most K/V bytes held at once, prefill and decoding included
    kv_bytes_decode_peak: int = 0  # the most K/V bytes held after a decode step (the compressed cache's if none)
    kv_bytes_decode_mean: float = 0.0  # their mean over the decode steps
    stop_reason: str = "max_new_tokens"  # eos, stop (a stop string or token), max_new_tokens, cancelled
    state_bytes: int = 0  # a hybrid model's recurrent state (linear attention / SSM / conv layers): constant, apart
    # from the K/V bytes above, which count attention layers only
    step: str = "eager"  # the decode step that ran: eager, static or captured (kvbench.engine.static)

    @property
    def kept_per_layer(self) -> list[float]:
        return [sum(h) / len(h) for h in self.kept_per_head]

    @property
    def kept_head_stats(self) -> list[tuple[int, float, int]]:
        """(min, mean, max) entries per head, per layer: how unevenly a per-head method spread its budget."""
        return [(min(h), sum(h) / len(h), max(h)) for h in self.kept_per_head]

    @property
    def effective_budget(self) -> float:
        per_layer = self.kept_per_layer
        return sum(per_layer) / len(per_layer)


def prefill(model, input_ids: Tensor, cache: KVCache, start: int = 0, inputs_embeds: Tensor | None = None) -> Tensor:
    """Full-attention forward over the prompt; fills `cache`; returns the last position's logits `[B, V]`.
    `start` > 0: a chunk after `start` tokens already in `cache` (compressed or not: the capture masks each layer
    as long as it is; `query=agnostic` feeds the question this way). Such a chunk meets layers of different lengths
    (PyramidKV's), a new attention shape per layer, so it runs without cuDNN's attention, as decode steps do.
    `inputs_embeds` `[B, q, hidden]` (the embeddings of `input_ids`): the forward starts from them and records
    autograd where the caller enabled it (KVgrad's replay, `engine.gradient_replay`); otherwise no graph is built."""
    pos = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)[None]
    inputs = {"input_ids": input_ids} if inputs_embeds is None else {"inputs_embeds": inputs_embeds}
    with without_cudnn_attention() if start else contextlib.nullcontext(), \
            torch.no_grad() if inputs_embeds is None else contextlib.nullcontext():
        out = model(**inputs, past_key_values=cache, position_ids=pos, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1]


@torch.no_grad()
def compress(method: Method, cache: KVCache, capture: AttentionCapture, budget: int | None,
             state: EvictionState | None = None, inv_freq: Tensor | None = None,
             layers_done: bool = False) -> TransferLedger | None:
    """Apply the method's per-layer budgets and selections to the cache; evicted entries are freed.

    Accumulated-attention methods (`state` given) evict from their prefill scores here and are hooked into every
    decode step. With `inv_freq` (positions=shift), every layer then hands attention its keys at cache slots.
    Storage methods (TailorKV) rebuild the layers themselves and return the ledger of bytes they move.
    `layers_done`: each layer was already evicted inside the prefill forward (`kvbench.engine.layerwise`)."""
    if not method.compresses:
        return None
    if capture.latent_layers:  # (the command line refused it before weights load; this is the Python API's check)
        check_latent(method)
    if method.kind is Kind.STORAGE:
        ledger = method.attach(cache, capture, budget)
        capture.trim_window_layers(cache)  # sliding-window layers keep what the model's window still shows
        return ledger
    if method.kind is Kind.RECONSTRUCTOR:  # one selection across all layers and heads from the reconstruction
        for layer_idx, idx in method.select_all(capture.key_scores, budget).items():
            if layer_idx in capture.latent_layers and isinstance(idx, list):
                idx = as_latent_selection(idx)
            apply_selection(method, cache, layer_idx, idx, source="select_all")
    elif not layers_done:
        n_layers = len(cache.layers)
        budgets = layer_budgets(method, cache.layers[0].keys.shape[-2], n_layers, budget)
        for layer_idx, n_keep in enumerate(budgets):
            compress_layer(method, cache, capture, layer_idx, n_layers, n_keep, state)
    if state is not None:
        state.prefill_done()  # a method deciding across layers (Keyformer's shared score) evicts now
    capture.reset()  # the window queries are no longer needed
    capture.cache = cache
    if state is not None and method.evicts_while_decoding:
        capture.decode_hook = EvictionHook(state, cache, capture.window_layers, dict(capture.softcap),
                                           dict(capture.sinks))
    capture.trim_window_layers(cache)
    enable_shift(cache, inv_freq)
    return None


@dataclass
class EvictionHook:
    """The capture's decode hook of one sample's decode-time evictor: after each layer's attention, its state scores
    the step and evicts from `cache`. A plain object (not a closure), so a prepared sample can be deep-copied."""

    state: EvictionState
    cache: KVCache
    fixed: frozenset[int]  # sliding-window layers keep the model's own window semantics
    softcap: dict[int, float]
    sinks: dict[int, Tensor] = field(default_factory=dict)  # learned sink logits per layer (gpt-oss), in each row

    def __call__(self, i: int, query: Tensor, key: Tensor, scaling: float, bias: Tensor | None = None,
                 logits: Tensor | None = None) -> None:
        if i not in self.fixed:
            self.state.decode(i, self.cache.layers[i], query, key, scaling, bias, self.softcap.get(i), logits,
                              sinks=self.sinks.get(i))

    def chunk(self, i: int, query: Tensor, key: Tensor, scaling: float) -> None:
        """After layer `i`'s attention of a fed chunk (`feed`): the state scores the chunk's rows and evicts."""
        if i not in self.fixed:
            self.state.chunk(i, self.cache.layers[i], query, key, scaling, self.softcap.get(i),
                             sinks=self.sinks.get(i))

    @staticmethod
    def together(hooks: list[EvictionHook], i: int, keys: list[Tensor], logits: list[Tensor]) -> None:
        """The hooks of several samples after one attention call (batched decoding), each with the keys its layer
        attended and its logits `[1, H_q, 1, k]`: scored and evicted together where their method allows
        (`EvictionState.decode_many`)."""
        live = [j for j, hook in enumerate(hooks) if i not in hook.fixed]
        EvictionState.decode_many([hooks[j].state for j in live], i, [hooks[j].cache.layers[i] for j in live],
                                  [keys[j] for j in live], [logits[j] for j in live])


@torch.no_grad()
def compress_layer(method: Method, cache: KVCache, capture: AttentionCapture, layer_idx: int, n_layers: int,
                   n_keep: int, state: EvictionState | None = None) -> None:
    """One layer's prefill eviction: the method's selection of `n_keep` entries per head, or a decoding method's
    eviction from its column sums. Needs only this layer's K/V and capture, so it can run inside the forward."""
    if layer_idx in capture.window_layers:  # sliding-window layers keep the model's own window semantics
        return
    if layer_idx in capture.latent_layers:
        check_latent(method)
    layer = cache.layers[layer_idx]
    input_scores = capture.input_scores.pop(layer_idx, None)  # (KVzap's; dropped even where nothing is evicted)
    if state is not None:
        held = layer.nbytes()
        state.prefill(layer_idx, layer, capture.column_sums.pop(layer_idx, None))
        if cache.layers[layer_idx].nbytes() != held:
            cache.note_peak(extra=held)  # the gather held the layer's old and new tensors at once
    elif n_keep < layer.keys.shape[-2] or method.prunes_channels:
        latent = layer_idx in capture.latent_layers  # MLA: scored as one latent KV head (`models.mla`)
        view = LayerView(layer_idx, n_layers, *capture.view_kv(layer_idx, layer),
                         capture.window_queries.get(layer_idx), capture.scaling.get(layer_idx, 1.0),
                         capture.window_bias.get(layer_idx), capture.softcap.get(layer_idx),
                         None if latent else capture.rotary.get(layer_idx),
                         None if latent else capture.output_weight(layer_idx),
                         question_len=capture.question_len, input_scores=input_scores,
                         sinks=capture.sinks.get(layer_idx))
        if n_keep < layer.keys.shape[-2]:
            heads = capture.model.config.get_text_config().num_attention_heads if method.selects_per_query_head \
                else None
            idx = select(method, view, n_keep, cache)
            if latent and isinstance(idx, list):  # one latent head: a per-head selection is one dense set, of the
                idx, n_keep = as_latent_selection(idx), None  # length its rule gave (Ada-KV's, DMS's)
            if idx is not None:  # None: the method keeps this layer whole (SimLayerKV's non-lazy layers)
                merged = method.merged_values(view, idx)  # (`+method.merge=true`: evicted values folded in)
                if merged is not None:
                    cache.note_peak(extra=merged.numel() * merged.element_size())  # beside the whole layer
                apply_selection(method, cache, layer_idx, idx, n_keep, heads)
                if merged is not None:  # stored in place of the kept values the gather made
                    cache.layers[layer_idx].values = merged
        if method.prunes_channels:  # ThinK: the kept keys' channels, chosen from what the selection kept
            kept = cache.layers[layer_idx]
            cache.layers[layer_idx] = ChannelPrunedLayer(kept, method.channels_to_keep(view, kept.keys))
            cache.note_peak(extra=kept.nbytes())  # the reduced keys were made while the kept ones were held
    kept = cache.layers[layer_idx]
    stored = method.stored_layer(kept)  # `+method.quantize`: what the selection kept, stored quantized
    if stored is not kept:
        cache.layers[layer_idx] = stored
        cache.note_peak(extra=kept.nbytes())  # the codes were made while the kept entries were held


def apply_selection(method: Method, cache: KVCache, layer_idx: int, idx: Tensor | list[Tensor],
                    n_keep: int | None = None, heads: int | None = None, source: str = "select") -> None:
    """Keep `idx` in one layer: `[B, H, k]` in place, or one index tensor per head, of different lengths, stored
    flattened (Ada-KV, KVzip). The evicted entries are freed. Every selection reaches the cache here, checked first
    (`contract.check_selection`: one line naming the method and its mistake); `heads`: the stored heads by default."""
    if not 0 <= layer_idx < len(cache.layers):
        raise ValueError(f"method {name_of(method)}: {source} returned layer {layer_idx}; expected layers 0.."
                         f"{len(cache.layers) - 1}")
    layer = cache.layers[layer_idx]
    b, h, n = layer.keys.shape[:3]
    check_selection(method, idx, layer_idx, n, b, h if heads is None else heads, n_keep, source)
    held = layer.nbytes()
    if isinstance(idx, Tensor):
        layer.keep(idx)
    else:
        cache.layers[layer_idx] = VarlenLayer.from_selection(layer, idx)
    if cache.layers[layer_idx].nbytes() != held:
        cache.note_peak(extra=held)  # the gather held the layer's old and new tensors at once


def enable_shift(cache: KVCache, inv_freq: Tensor | None) -> None:
    """positions=shift: from now on each layer's attention sees its keys at consecutive cache slots."""
    if inv_freq is None:
        return
    for layer in cache.layers:
        if getattr(layer, "is_varlen", False):
            raise ValueError("positions=shift: per-head variable layers (Ada-KV) are not supported")
        if isinstance(layer, ChannelPrunedLayer):
            raise ValueError("positions=shift: channel-pruned keys (key_channels) are not supported")
        layer.shift_inv_freq = inv_freq


def sampling_generator(sampling: Sampling, device: torch.device) -> torch.Generator | None:
    """The seeded generator of a sampled decode (None when greedy), on the logits' device: `multinomial` needs its
    generator there, so a CUDA run samples from a CUDA stream (seeded alike, but not the CPU's numbers)."""
    return torch.Generator(device=device).manual_seed(sampling.seed) if sampling.do_sample else None


def next_token(logits: Tensor, sampling: Sampling, generator: torch.Generator | None) -> Tensor:
    """`[B, V]` logits -> `[B, 1]` token ids."""
    if not sampling.do_sample:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / max(sampling.temperature, 1e-6)
    if sampling.top_k > 0:
        kth = logits.topk(min(sampling.top_k, logits.shape[-1])).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > sampling.top_p  # keep the smallest prefix reaching top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)


@dataclass
class Prepared:
    """A prompt after prefill and compression, ready to decode: its cache, first logits and accounting.
    The engine (`kvbench.engine.batching`) decodes it, alone or with others."""

    cache: KVCache
    logits: Tensor  # [1, V], the prompt's last position: the first generated token's distribution
    prompt_len: int
    full_kv_bytes: int
    kv_bytes: int
    kept_per_head: list[list[int]]
    kv_bytes_per_layer: list[int]
    ledger: TransferLedger | None
    timings: dict[str, float]
    state: EvictionState | None = None  # a decode-time method's per-sample state (beam search reorders it)
    held_elsewhere: int = 0  # KV bytes held beside this cache (a grid sweep's shared prefilled cache)

    @classmethod
    def from_cache(cls, cache: KVCache, logits: Tensor, prompt_len: int, ledger: TransferLedger | None = None,
                   full_kv_bytes: int | None = None) -> Prepared:
        """A cache prefilled and compressed by hand (`prefill` + `compress`), to decode through the engine."""
        return cls(cache, logits, prompt_len, cache.nbytes() if full_kv_bytes is None else full_kv_bytes,
                   cache.nbytes(), cache.entries_per_head(), [layer.nbytes() for layer in cache.layers], ledger, {})

    def finish(self, tokens: list[int], text: str, n_steps: int, decode_s: float,
               stop_reason: str = "max_new_tokens") -> Generation:
        """The Generation record once decoding ended (`n_steps` decode forwards in `decode_s` seconds). `e2e_s`: the
        sample's own model time, prefill to last token (compression can lengthen the output, and so this)."""
        timings = {**self.timings, "decode_s": decode_s,
                   "decode_tok_s": (n_steps / decode_s) if n_steps and decode_s > 0 else 0.0}
        timings["e2e_s"] = sum(timings.get(k, 0.0) for k in ("prefill_s", "compress_s", "question_s", "decode_s"))
        steps, cache = self.cache.decode_steps, self.cache
        return Generation(tokens, text, self.prompt_len, self.kv_bytes, self.full_kv_bytes, self.cache.nbytes(),
                          self.kept_per_head, timings, self.kv_bytes_per_layer,
                          [layer.nbytes() for layer in self.cache.layers], self.cache.host_nbytes(),
                          self.ledger.summary() if self.ledger is not None else None,
                          self.cache.peak_nbytes + self.held_elsewhere,
                          cache.decode_peak_nbytes if steps else self.kv_bytes,
                          cache.decode_sum_nbytes / steps if steps else float(self.kv_bytes), stop_reason,
                          cache.state_nbytes())


@dataclass
class Prefilled:
    """A prompt prefilled once for several configurations (a grid sweep): `prepare` compresses a copy of `cache`
    from this configuration's view of the shared capture (the widest window's queries, its own column sums)."""

    cache: KVCache
    logits: Tensor
    prefill_s: float
    state: EvictionState | None = None  # a decoding method's state, started before the prefill that scored it
    window_queries: dict[int, Tensor] = field(default_factory=dict)
    window_bias: dict[int, Tensor] = field(default_factory=dict)
    scaling: dict[int, float] = field(default_factory=dict)
    column_sums: dict[int, Tensor] = field(default_factory=dict)  # this configuration's scorer's, if any
    input_scores: dict[int, Tensor] = field(default_factory=dict)  # its method's scores of the inputs (KVzap)

    def restore(self, capture: AttentionCapture) -> None:
        """Put the shared prefill's statistics where `compress` reads them (it clears them after use)."""
        capture.reset()
        capture.window_queries.update(self.window_queries)
        capture.window_bias.update(self.window_bias)
        capture.scaling.update(self.scaling)
        capture.column_sums.update(self.column_sums)
        capture.input_scores.update(self.input_scores)


def prepare(model, method: Method, capture: AttentionCapture, input_ids: Tensor, budget: int | None,
            max_new_tokens: int, positions: str = "original", seed: int = 0, compress_after: str = "layer",
            prefilled: Prefilled | None = None, question_len: int = 0,
            recompress: DecodeCompression = DecodeCompression()) -> Prepared:
    """Prefill one prompt `[1, n]` and compress its cache. Leaves the sample's decode hooks set on `capture`
    (`recompress` on: the hook that compresses again while decoding, `kvbench.engine.recompress`).

    `compress_after`: "layer" evicts each layer inside the prefill forward where the method allows it
    (`kvbench.engine.layerwise`), "prefill" after the whole prefill; the kept entries are the same. `prefilled`: skip the
    prefill and compress a copy of a shared one (the grid launcher). `question_len` > 0 (`query=agnostic`): the last
    `question_len` tokens are the question: the context before them is prefilled and compressed alone (the method's
    window queries are the context's last tokens), then the question is prefilled on top of the compressed cache
    (`feed`) and kept whole (a decode-time evictor scores it and evicts to its budget); decoding starts after it,
    at position n. A method whose `window_is_question` (FINCH, query=aware) instead keeps the question in the
    prompt and gets its length as each layer's `view.question_len`."""
    if positions not in ("original", "shift"):
        raise ValueError(f"positions={positions!r} is not one of original, shift")
    if positions == "shift" and method.kind is Kind.STORAGE:
        raise ValueError(f"positions=shift applies to eviction methods, not to {method.registry_name}")
    if compress_after not in ("layer", "prefill"):
        raise ValueError(f"compress_after={compress_after!r} is not one of layer, prefill")
    n = input_ids.shape[1]
    question_window = 0
    if question_len and method.window_is_question:  # the question stays in the prompt: it is the window (FINCH)
        question_window, question_len = question_len, 0
    if question_len and (prefilled is not None or not method.takes_chunks or not 0 < question_len < n):
        raise ValueError(f"query=agnostic: a {question_len}-token question after a {input_ids.shape[1]}-token "
                         f"prompt cannot be fed on top of {method.registry_name}'s compressed cache here")
    prompt_len = input_ids.shape[1]
    own = None if recompress.on else method.own_decode_compression(budget)
    if own is not None:  # a method that compresses while decoding by itself (R-KV), unless the run says otherwise
        recompress = DecodeCompression(*own)
    decode_window = method.query_window if recompress.on and recompress.counted == "sequence" else 0
    question, input_ids = (input_ids[:, input_ids.shape[1] - question_len:],
                           input_ids[:, :input_ids.shape[1] - question_len]) if question_len else (None, input_ids)
    capture.logit_scale = getattr(method, "logit_scale", None)  # BUZZ log n: a temperature on every layer
    inv_freq = model_inv_freq(model, capture.adapter) if positions == "shift" else None
    sync = torch.cuda.synchronize if input_ids.is_cuda else (lambda: None)  # CUDA timings: wait for the kernels
    if prefilled is not None:  # a shared prefill: this configuration compresses its own copy
        prefilled.restore(capture)
        hold_decode_queries(capture, decode_window, capture.window_queries)
        capture.question_len = question_window
        cache, logits, state = prefilled.cache.clone(), prefilled.logits, prefilled.state
        held_elsewhere = full_bytes = prefilled.cache.nbytes()
        sync()
        t1 = time.perf_counter()
        t0 = t1 - prefilled.prefill_s
        if method.kind is Kind.RECONSTRUCTOR:
            reconstruct(model, method, capture, cache, input_ids, budget)
        ledger = compress(method, cache, capture, budget, state, inv_freq)
    else:
        cache, state, held_elsewhere = KVCache(), None, 0
        capture.reset()
        hold_decode_queries(capture, decode_window)
        capture.window = max(method.query_window, question_window)
        capture.question_len = question_window
        if method.scores_inputs:
            capture.input_scorer = functools.partial(method.input_scores, config=model.config.get_text_config())
        if method.kind is Kind.EVICTOR:
            state = method.start(input_ids.shape[1], budget, max_new_tokens, seed)
            if method.accumulates_attention:
                capture.column_score = lambda logits: method.row_score(logits, state, decoding=False)
                capture.column_block = method.causal_block(state.budget)
        in_forward = compress_after == "layer" and layerwise.applies(method)
        with layerwise.compress_each_layer(capture, method, cache, budget, input_ids.shape[1], state, active=in_forward,
                                           compress_layer=compress_layer) as done:
            sync()
            t0 = time.perf_counter()
            logits = prefill(model, input_ids, cache)
            sync()
            t1 = time.perf_counter()
        full_bytes = done.full_nbytes if in_forward else cache.nbytes()
        if method.kind is Kind.RECONSTRUCTOR:  # (inside compress_s: the reconstruction prefills score the cache)
            reconstruct(model, method, capture, cache, input_ids, budget)
        ledger = compress(method, cache, capture, budget, state, inv_freq, layers_done=in_forward)
        t1 -= done.compress_s  # evictions inside the forward count as compression time
    sync()
    t2 = time.perf_counter()
    timings = {"prefill_s": t1 - t0, "compress_s": t2 - t1}
    if question is not None:
        held = cache.nbytes()
        logits = feed(model, capture, cache, question, positions)
        full_bytes += cache.nbytes() - held  # the question's entries: a full cache holds them too
        sync()
        timings["question_s"] = time.perf_counter() - t2
    if recompress.on:
        capture.decode_hook = Recompressor(method, cache, recompress, dict(capture.softcap), capture.rotary,
                                           frozenset(capture.window_layers), take_decode_queries(capture))
    return Prepared(cache, logits, prompt_len, full_bytes, cache.nbytes(), cache.entries_per_head(),
                    [layer.nbytes() for layer in cache.layers], ledger, timings, state, held_elsewhere)


def feed(model, capture: AttentionCapture, cache: KVCache, tokens: Tensor, positions: str = "original") -> Tensor:
    """Prefill `tokens` `[1, q]` on top of a (compressed) cache, keeping them all: the question of `query=agnostic`,
    a turn of a conversation. Through `prefill` (no new model call site); the capture masks each layer for its own
    length and attends layers with their own storage (Ada-KV; Quest, PQCache, TailorKV hand the chunk their whole cache)
    itself. The window is off (no selection runs); a decode-time evictor (H2O, TOVA, Keyformer, BUZZ, the rolling
    windows) scores the chunk's rows into its state as at prefill and evicts each layer to its budget after the
    layer's attention (`EvictionHook.chunk`). Returns the last token's logits."""
    start = cache.layers[0].seen_tokens
    if positions == "shift":  # pos-shift: the chunk goes right after the kept entries, as decoding would place it
        start = cache.layers[0].keys.shape[-2]
        for layer in cache.layers:
            layer.next_position = start
    window, capture.window = capture.window, 0
    try:
        logits = prefill(model, tokens, cache, start)
    finally:
        capture.window = window
    if isinstance(capture.decode_hook, EvictionHook):  # every layer scored the chunk: a shared score decides now
        capture.decode_hook.state.prefill_done()
    return logits


@torch.no_grad()
def reconstruct(model, method: Method, capture: AttentionCapture, cache: KVCache, context_ids: Tensor,
                budget: int | None) -> None:
    """KVzip's scoring pass: for each reconstruction input the method builds from the context (a "repeat the
    context" prompt and one chunk of the context itself), prefill it on top of the full context cache at the
    positions after the context (`prefill`: no new model call site), let the capture hand every layer's rows and
    keys to the method's scorer, then drop the input's K/V again (`truncate`), so each chunk sees the context alone.
    Leaves `capture.key_scores[layer]` `[B, H_kv, n]` for `compress`. Nothing to do when the context fits."""
    n = cache.layers[0].seen_tokens
    if budget is None or budget >= n:
        return
    if method.scores_inputs:  # Fast KVzip: a gate scored each layer's prefill input; nothing to replay
        if not capture.input_scores:
            raise ValueError(f"{method.registry_name}: no scores from the layers' inputs reached the selection (the "
                             "prefill ran without the capture's input scorer, `capture.input_scorer`)")
        capture.key_scores = {i: s for i, s in capture.input_scores.items() if i not in capture.window_layers}
        return
    scores = {i: torch.zeros(*layer.keys.shape[:2], n, device=layer.keys.device)
              for i, layer in enumerate(cache.layers) if i not in capture.window_layers}
    if method.replay_gradient:  # KVgrad: the replay runs with autograd
        reconstruct_with_gradients(model, method, capture, cache, context_ids, scores, prefill)
        capture.key_scores = scores
        return
    span = (0, 0)
    kvzip_plus = getattr(method, "kvzip_plus", False)  # KVzip+ also reads the values, the rows' input and W_o

    def score(layer_idx: int, query: Tensor, key: Tensor, scaling: float, softcap: float | None, **inputs) -> None:
        if layer_idx in scores:
            plus = dict(output_weight=capture.output_weight(layer_idx), **inputs) if kvzip_plus else {}
            scores[layer_idx][..., span[0]:span[1]] = method.chunk_scores(query, key, scaling, *span, softcap, **plus)

    window, capture.window, capture.prefill_hook = capture.window, 0, score
    states = cache.states.clone()  # a hybrid's recurrent state cannot drop the input's tokens: restored instead
    try:
        for start, end, ids in method.reconstruction_inputs(context_ids):
            span = (start, end)
            prefill(model, ids, cache, start=n)
            for layer in cache.layers:
                layer.truncate(n)
            cache.states = states.clone()
    finally:
        capture.window, capture.prefill_hook = window, None
    capture.key_scores = scores


def eos_token_ids(model, tokenizer) -> set[int]:
    """EOS ids from the generation config (may be a list) and the tokenizer."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return ids
