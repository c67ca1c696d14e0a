"""Batched decoding with continuous batching: up to N samples decode together, each over its own compressed cache.

Each prompt is prefilled and compressed alone (`generation.prepare`: exact, no padding inside a prompt). Decoding
then runs one model forward per step for every active sample: embeddings, norms, RoPE, MLPs and the LM head see an
`[N, 1]` batch, so the weights are read once for N tokens (decode is weight-read bound). Attention: a sample's plain
dense layers (no decode-time eviction, temperature, prefetch or position shift: SnapKV, PyramidKV, StreamingLLM,
full...) move into rows shared with the other samples (`kvbench.cache.rows`): decoded tokens are written in place
and one call per layer attends every row, masked to each row's length. Per-head variable layers (Ada-KV, KVzip) move
into a pool of their own (`kvbench.cache.varlen.VarlenRows`): one padded block per layer and step for all of them,
one engine call. Once two samples of one evictor that scores `together` (H2O) and one budget decode, their layers
move into evicting rows (`kvbench.cache.evicting_rows`): one append, one engine call and one eviction per layer for
all of them. Every other sample's layer (TailorKV's offloaded and quantized layers, the layers of Keyformer / BUZZ
with their decode-time eviction, a BUZZ log n temperature) goes into ONE call of the engine's decode attention
(`kvbench.attention.decode`) with what they hold this step (`decode_kv`), whatever the lengths per sample, layer
and head; each sample's temperature scales its own logits, and its evictor scores the logits of that call (no second
computation). So a layer costs one attention call per set of rows or pool and one for the rest, whatever the batch;
a lone sample outside them takes batch 1's path. Per-sample method work that several samples can share runs once for them: a
layer type's `decode_kv_many` (TailorKV's top-k retrieval), and hooks with a `together` (TailorKV's predicted-query
prefetch, H2O's scoring and eviction for samples of one budget outside rows). A sample that finishes
leaves at once and the next prompt is prefilled and joins (continuous batching), so one long generation does not
hold the others back. A request may bring its own `Decoding` (method, sampling, positions) and a prefill shared with
other requests (`generation.Prefilled`): the grid launcher decodes the configurations of a sweep together this way.
A request may also be a step of something longer: `on_join` prepares it when it joins (a conversation's next turn,
fed on its cache then) and `then` gives its follow-up once it has finished, admitted before any new request
(`kvbench.engine.turns`: conversations decode together; `kvbench.runs.follow_up`: a second question with a prompt of
its own, LongBench v2's CoT). A sample whose prefill, compression, token choice or
batched step raises comes back as its exception; the others go on.

Equality with batch 1. Sampling, eviction rules and positions (`prompt_len_i + t`) are per sample, as in batch 1.
The arithmetic is not bit-identical: an `[N, d] x [d, m]` matmul runs a GEMM whose reduction order differs from the
`[1, d]` GEMV of batch 1 (about 1e-7 relative in fp32 on the CPU, more in bf16/fp16), and attention over shared rows
or the engine's padded call rounds differently from one sample at a time (~1e-7 in fp32). So a greedy argmax, or an
evictor's top-k, can flip where two candidates are that close; after a flip the continuations differ. On the tiny
test models and the embedded model at fp32 no flip occurred (tests/unit/test_batching.py checks tokens, logits and
evictors' scores; scripts/bench_batch.py checks tokens on the embedded model).

No index goes from the host to the device in the per-step bookkeeping (rows are written with host-side slices; the
index of a set of samples is made once per set, `index_of`), so CUDA streams are not synchronized by it; tokens are
read to the host once per step for all samples. On CUDA the engine's call runs flash-attn varlen over (sample, KV
head) segments where it can, else PyTorch's fused attention, and no decode step runs cuDNN's (see
`kvbench.attention.decode`). Failure records, sharding and the record layout stay in `kvbench.run`; this module only
generates.
"""
from __future__ import annotations

import copy
import functools
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvbench.attention.decode import decode_attention, without_cudnn_attention
from kvbench.attention.sinks import sinks_of
from kvbench.cache.evicting_rows import EvictingLayer, EvictingRows
from kvbench.cache.hybrid import batched
from kvbench.cache.kv_cache import DecodeKV, KVLayer
from kvbench.cache.rows import RowLayer, Rows, append
from kvbench.cache.varlen import VarlenLayer, VarlenRows
from kvbench.engine.recompress import DecodeCompression, Recompressor
from kvbench.engine.generation import (EvictionHook, Generation, Prefilled, Prepared, Sampling, eos_token_ids,
                                       next_token, prepare, sampling_generator)
from kvbench.methods.base import Method
from kvbench.methods.decoding import EvictionState
from kvbench.models.capture import AttentionCapture, refuse_window
from kvbench.models.mla import is_latent

_ids = itertools.count()


@dataclass(eq=False)
class Decoding:
    """How a request is generated: its method, sampling, positions and where compression happens (at prefill, and
    while decoding with `recompress` on)."""

    method: Method
    sampling: Sampling = field(default_factory=Sampling)
    positions: str = "original"
    compress_after: str = "layer"
    recompress: DecodeCompression = DecodeCompression()


@dataclass(eq=False)
class Request:
    """One prompt to generate for; `tag` travels with it back to the caller (e.g. the dataset sample)."""

    input_ids: Tensor  # [1, n]
    budget: int | None
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    min_new_tokens: int = 0
    seed: int = 0  # per-sample method randomness (Keyformer's noise), as `generate(seed=...)`
    tag: object = None
    decoding: Decoding | None = None  # None: the decoder's; a grid sweep mixes its configurations in one batch
    prefilled: Prefilled | None = None  # a prefill shared with other requests: compress a copy (`generation.prepare`)
    prepared: Prepared | None = None  # already prefilled and compressed (by hand): decode it as it is
    on_logits: Callable[[int, Tensor], None] | None = None  # sees step t's logits before the token is chosen
    forced: list[int] | None = None  # a teacher-forced stream: step t feeds forced[t] (no EOS or stop ends it)
    beams: object = None  # `beam.BeamSearch`: the token rule of a beam sequence (its cache has a row per beam)
    question_len: int = 0  # query=agnostic: the last tokens of input_ids, fed after compression (generation.prepare)
    on_join: Callable[[], Prepared] | None = None  # prepares it when it joins (a conversation's turn, fed then)
    # its follow-up once it has finished: the next turn, fed on this cache by its `on_join` (the cache is kept), or
    # a new prompt of its own (LongBench v2's second CoT question: this cache is freed)
    then: Callable[[Generation], Request | None] | None = None
    # set from another thread (a server's client left, or it shuts down): the sample ends at its next step with
    # stop_reason "cancelled", and its rows and cache are freed as any finished sample's
    cancelled: bool = False

    @classmethod
    def from_sample(cls, sample, ids: list[int], budget: int | None, seed: int, device, **fields) -> Request:
        """A dataset `Sample` with its token ids; the tag is `(sample, ids)` unless `fields` give another."""
        fields.setdefault("tag", (sample, ids))
        return cls(torch.tensor([ids], device=device), budget, sample.max_new_tokens, tuple(sample.stop),
                   tuple(sample.stop_token_ids), sample.min_new_tokens, seed, **fields)


@runtime_checkable
class Source(Protocol):
    """Requests that arrive over time (kvbench.serving's arrivals under a KV pool) instead of a list: `poll(active)`
    gives a request that may join now, or None; `wait()` is called while nothing runs and none may join: it waits
    until one may, and says False once none ever will. A request that finishes is yielded by `run` before the next
    `poll`, so the caller frees what it held first."""

    def poll(self, active: deque[Slot]) -> Request | None: ...

    def wait(self) -> bool: ...


@dataclass(eq=False)
class Slot:
    """A sample in the batch: its prepared cache, the capture hooks its method set, and its decode progress."""

    request: Request
    decoding: Decoding
    run: Prepared
    decode_hook: object
    input_hook: object
    logit_scale: object  # BUZZ log n: a temperature on this sample's attention
    generator: torch.Generator | None
    logits: Tensor  # [1, V]: the distribution of the next token
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    t: int = 0  # tokens chosen so far
    n_forward: int = 0
    stopped: bool = False  # a stop string appeared: `text` is already cut before it
    stop_reason: str = "max_new_tokens"  # why it ended: eos, stop (a stop string or token), max_new_tokens, cancelled
    decode_s: float = 0.0  # wall time of the batched forwards this sample took part in (not others' prefills)


def attended(module, keys: Tensor, values: Tensor, *rest) -> tuple:
    """What an attention call takes of a layer's stored keys and values (and a mask, passed on): an MLA layer's
    latents expanded per head by the module itself, as its forward does (`kvbench.models.mla`)."""
    if is_latent(module):
        keys, values = module.expand_kv(keys, values)
    return (keys, values, *rest)


class BatchedCache:
    """The cache object the batched forward sees: appends each sample's new K/V to that sample's own cache and
    keeps what each layer's update returned, for the per-sample attention. Holds no K/V of its own."""

    def __init__(self, slots: list[Slot]):
        self.slots = slots
        self.updated: dict[int, dict[int, tuple[Tensor, Tensor]]] = {}  # layer -> sample -> its keys, values
        self.is_compileable = False
        self.handed: dict[tuple[str, int, int], Tensor] = {}  # hybrids: the samples' states joined for the model

    def update(self, key_states: Tensor, value_states: Tensor, model_layer: int, *args, **kwargs):
        in_rows: dict[int, list[tuple[int, RowLayer]]] = {}
        layer_idx = self.slots[0].run.cache.slot_of[model_layer]  # (a hybrid's attention layers: their slots)
        for i, slot in enumerate(self.slots):
            layer = slot.run.cache.layers[layer_idx]
            if isinstance(layer, RowLayer):
                in_rows.setdefault(id(layer.rows), []).append((i, layer))
            else:
                self.updated.setdefault(layer_idx, {})[i] = slot.run.cache.update(
                    key_states[i:i + 1], value_states[i:i + 1], model_layer)
        for members in in_rows.values():
            rows = members[0][1].rows
            if isinstance(rows, EvictingRows):  # every row's token in one copy
                slot_idx, row_idx = [i for i, _ in members], [layer.row for _, layer in members]
                keys, values, n_rows = key_states, value_states, len(rows.owners)
                if slot_idx != row_idx or n_rows != len(self.slots):  # (else the batch is the rows)
                    keys, values = (scattered(x, slot_idx, row_idx, n_rows) for x in (keys, values))
                rows.append_all([layer for _, layer in members], keys[:, :, 0], values[:, :, 0])
            else:
                append([layer for _, layer in members], [key_states[i] for i, _ in members],
                       [value_states[i] for i, _ in members])
            for i, _ in members:  # (their attention reads the rows, not `updated`)
                if layer_idx == len(self.slots[i].run.cache.layers) - 1:
                    self.slots[i].run.cache.note_step()
        return key_states, value_states  # placeholders: the attention below reads `updated`

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(slot.run.cache.get_seq_length(layer_idx) for slot in self.slots)

    # --- hybrid models: every sample's recurrent state as one batch for the model's linear layers ---------------
    def _joined(self, kind: str, layer_idx: int, state_idx: int) -> Tensor | None:
        """The samples' `kind` state of a layer as one batch; handed tensors the model may update in place (the
        conv state at a decode step) go back to the samples after the forward (`write_back`)."""
        joined = batched([getattr(slot.run.cache.states, f"get_{kind}_state")(layer_idx, state_idx)
                          for slot in self.slots])
        if joined is not None:
            self.handed[(kind, layer_idx, state_idx)] = joined
        return joined

    def _update(self, kind: str, states: Tensor, layer_idx: int, state_idx: int, **kwargs) -> Tensor:
        self.handed.pop((kind, layer_idx, state_idx), None)  # (replaced: nothing to write back)
        return torch.cat([getattr(slot.run.cache.states, f"update_{kind}_state")(
            states[i:i + 1], layer_idx, state_idx, **kwargs) for i, slot in enumerate(self.slots)])

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> Tensor | None:
        return self._joined("conv", layer_idx, state_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> Tensor | None:
        return self._joined("recurrent", layer_idx, state_idx)

    def update_conv_state(self, conv_states: Tensor, layer_idx: int, state_idx: int = 0, **kwargs) -> Tensor:
        return self._update("conv", conv_states, layer_idx, state_idx, **kwargs)

    def update_recurrent_state(self, recurrent_states: Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        return self._update("recurrent", recurrent_states, layer_idx, state_idx, **kwargs)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return all(slot.run.cache.has_previous_state(layer_idx, state_idx) for slot in self.slots)

    def get_linear_cache(self, layer_idx: int) -> Tensor | None:  # (MiniMax's lightning attention)
        return self._joined("linear", layer_idx, 0)

    def set_linear_cache(self, layer_idx: int, linear_cache: Tensor) -> None:
        self._update("linear", linear_cache, layer_idx, 0)

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def write_back(self) -> None:
        """After the forward: each sample's rows of the joined states it was handed, into its own state."""
        for (kind, layer_idx, state_idx), joined in self.handed.items():
            for i, slot in enumerate(self.slots):
                getattr(slot.run.cache.states, f"get_{kind}_state")(layer_idx, state_idx).copy_(joined[i:i + 1])
        self.handed.clear()


class BatchedDecoder:
    """Continuous batching over one model and one capture; see the module docstring. Use `run(requests)`."""

    def __init__(self, model, tokenizer, method: Method, capture: AttentionCapture, batch_size: int,
                 sampling: Sampling = Sampling(), positions: str = "original", eos_ids: set[int] | None = None,
                 compress_after: str = "layer", recompress: DecodeCompression = DecodeCompression()):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        if capture is not None and batch_size > 1:
            family = capture.adapter.family
            indexed = any(getattr(m, "indexer", None) is not None for m in capture.attention_modules.values())
            if capture.adapter.replaces is not None or capture.window_layers or indexed:  # masks/attention bypass us
                raise ValueError(f"batch_size={batch_size}: {family} (attention outside transformers' "
                                 "AttentionInterface, sliding-window layers, or a DSA sparse-attention indexer whose "
                                 "top-k is one call over one cache) decodes at batch_size=1 only")
        self.model, self.tokenizer, self.capture, self.batch_size = model, tokenizer, capture, batch_size
        self.decoding = Decoding(method, sampling, positions, compress_after, recompress)
        self.eos_ids = eos_token_ids(model, tokenizer) if eos_ids is None else set(eos_ids)
        self.name = f"kvbench_batched_{next(_ids)}"
        self.cache: BatchedCache | None = None
        self.rows: dict[tuple, Rows] = {}  # the plain dense layers of the active samples, per layer and capacity
        self.active: deque[Slot] = deque()  # the samples decoding now (`run`)
        self.on_join: Callable[[Slot], None] | None = None  # sees each slot once it has joined (its prompt's logits)
        self.on_step: Callable[[deque[Slot]], None] | None = None  # sees the active slots after each batched forward
        # at most this many requests join (each prefilled) between two batched steps; None: as many as fit. A server
        # takes 1, so a burst's first request gets its first token before the others' prefills, not after them
        self.joins_per_step: int | None = None

    @property
    def method(self) -> Method:
        return self.decoding.method

    # --- the loop ---------------------------------------------------------------------------------------------
    def run(self, requests: Iterable[Request]) -> Iterator[tuple[Request, Generation | Exception]]:
        """Yield (request, generation) as each sample finishes (completion order, not request order). A request
        whose prefill or compression raised yields its exception instead, and so does every sample of a batched
        step that raised; the others go on (one failing sample must not stop the rest).
        `requests` may be a `Source` (a load benchmark's arrivals under a KV pool): it is polled for a request that
        may join now, and waited on while nothing runs."""
        source = requests if isinstance(requests, Source) else None
        pending, active, follow = iter(()) if source else iter(requests), deque(), deque()
        self.active = active
        AttentionInterface.register(self.name, self._attention)
        try:
            while True:
                joins = 0
                while len(active) < self.batch_size and (self.joins_per_step is None or joins < self.joins_per_step) \
                        and (request := follow.popleft() if follow else source.poll(active) if source
                             else next(pending, None)) is not None:
                    joins += 1
                    try:
                        active.append(self._into_rows(self._join(request)))
                        if self.on_join is not None:
                            self.on_join(active[-1])
                    except Exception as e:  # noqa: BLE001 - this sample's failure, reported to the caller
                        self.capture.reset()
                        yield request, e
                    finally:
                        request.prefilled = None  # its copy is made (or failed): the shared prefill may go
                if not active:
                    if self.joins_per_step is not None and joins >= self.joins_per_step:
                        continue  # (the joins this step all failed: admit the next ones)
                    if source is not None and source.wait():
                        continue
                    return
                chosen = [(slot, self._try(self._choose, slot)) for slot in active]
                picked = [token for slot, token in chosen if isinstance(token, Tensor) and not slot.request.beams]
                values = iter(torch.cat(picked).view(-1).tolist() if picked else [])  # one device->host read
                stepping = []
                for slot, token in chosen:  # going on: True; ended: False, None or the exception that ended it
                    if isinstance(token, Tensor):  # (a beam sequence's rule read its own tokens)
                        going = self._try(self._accept, slot, None if slot.request.beams else next(values))
                    else:
                        going = token
                    if going is True:
                        stepping.append((slot, token))
                        continue
                    active.remove(slot)
                    outcome = going if isinstance(going, Exception) else self._try(self._finish, slot)
                    then = slot.request.then if isinstance(outcome, Generation) else None
                    after = then(outcome) if then is not None else None
                    self._leave_rows(slot, keep=after is not None and after.on_join is not None)  # (fed on it)
                    if after is not None:
                        follow.append(after)  # admitted before any new request: its cache is held meanwhile
                    yield slot.request, outcome
                if stepping:
                    try:
                        self._forward(stepping)
                    except Exception as e:  # noqa: BLE001 - the step's samples fail together; the rest go on
                        for slot, _ in stepping:
                            active.remove(slot)
                            self._leave_rows(slot)
                            yield slot.request, e
                    if self.on_step is not None:
                        self.on_step(active)
        finally:
            AttentionInterface._global_mapping.pop(self.name, None)
            if self.batch_size == 1:  # the last sample's hooks
                self.capture.reset()
            self.capture.logit_scale = None  # set per method by `prepare`
            self.rows = {}

    def _join(self, request: Request) -> Slot:
        """Prefill and compress one prompt alone (or a copy of its shared prefill); keep the hooks its method set
        on the capture."""
        decoding = request.decoding or self.decoding
        if request.beams is not None and self.batch_size > 1:
            raise ValueError("beam search decodes at batch_size=1 (its cache has a row per beam)")
        if request.on_join is not None:  # (it leaves its hooks on the capture, as prepare does)
            run = request.on_join()
        else:
            run = request.prepared or prepare(self.model, decoding.method, self.capture, request.input_ids,
                                              request.budget, request.max_new_tokens, decoding.positions,
                                              request.seed, decoding.compress_after, request.prefilled,
                                              request.question_len, decoding.recompress)
        generator = sampling_generator(decoding.sampling, run.logits.device)
        slot = Slot(request, decoding, run, self.capture.decode_hook, self.capture.input_hook,
                    self.capture.logit_scale, generator, run.logits)
        if self.batch_size > 1:  # the hooks travel with the slot; a batch of one keeps them on the capture
            self.capture.reset()
            self.capture.logit_scale = None
        return slot

    def _into_rows(self, slot: Slot) -> Slot:
        """At batch_size > 1, move the slot's plain dense layers into the batch's shared rows (`kvbench.cache.rows`),
        and its per-head variable layers into a pool (`kvbench.cache.varlen.VarlenRows`): no decode-time eviction
        (but compression while decoding with uniform shares: rows of a fixed capacity, compacted in place),
        temperature, prefetch, position shift or sliding window. Rows are per layer and capacity, so samples of one
        budget share them and a long full cache does not widen the others'."""
        hook, new_tokens = slot.decode_hook, slot.request.max_new_tokens
        compacted = isinstance(hook, Recompressor) and hook.bound(0, new_tokens) is not None  # fixed capacity
        if self.batch_size == 1 or slot.input_hook is not None or slot.logit_scale is not None \
                or getattr(self.model.config, "sliding_window", None):
            return slot  # (a uniform window, Mistral v0.1 / Phi-3, is masked per sample by each key's position)
        if isinstance(hook, EvictionHook) and hook.state.method.together:
            return self._into_evicting_rows(slot, hook)
        if hook is not None and not compacted:
            return slot
        layers = slot.run.cache.layers
        try:
            for i, layer in enumerate(layers):
                kind = Rows if type(layer) is KVLayer else VarlenRows if type(layer) is VarlenLayer else None
                if kind is not None and layer.is_initialized and layer.shift_inv_freq is None:
                    bound = hook.bound(layer.keys.shape[-2], new_tokens) if compacted else None
                    capacity = Rows.capacity_for(layer, new_tokens, bound)
                    key = (i, capacity, layer.keys.shape[1], layer.keys.shape[-1], layer.keys.dtype,
                           layer.keys.device, kind)
                    if key not in self.rows:
                        self.rows[key] = kind(layer, capacity)
                    layers[i] = self.rows[key].take(layer)
        except BaseException:
            self._leave_rows(slot)
            raise
        return slot

    def _into_evicting_rows(self, slot: Slot, hook: EvictionHook) -> Slot:
        """Once a second sample of its method and budget decodes, move the layers of samples whose evictor scores
        `together` (H2O) into rows shared with them (`kvbench.cache.evicting_rows`), each layer that holds exactly
        its budget (the others, e.g. of a prompt shorter than the budget, evict alone). A lone sample keeps its own
        layers: rows of one would save nothing."""
        state = hook.state
        peers = [other for other in self.active if isinstance(other.decode_hook, EvictionHook)
                 and other.decode_hook.state.method is state.method and other.decode_hook.state.budget == state.budget]
        for peer in peers:  # (a peer that decoded alone so far moves in now)
            self._evict_in_rows(peer, peer.decode_hook)
        try:
            if peers:
                self._evict_in_rows(slot, hook)
        except BaseException:
            self._leave_rows(slot)
            raise
        return slot

    def _evict_in_rows(self, slot: Slot, hook: EvictionHook) -> None:
        state, layers = hook.state, slot.run.cache.layers
        for i, layer in enumerate(layers):
            if i in hook.fixed or not EvictingRows.fits(layer, state.budget):
                continue
            key = (i, "evicting", id(state.method), state.budget, layer.keys.shape[1], layer.keys.shape[-1],
                   layer.keys.dtype, layer.keys.device)
            if key not in self.rows:
                self.rows[key] = EvictingRows(layer, state.budget)
            layers[i] = state.layers[i] = self.rows[key].take_scored(layer, state.scores[i], state)

    def _leave_rows(self, slot: Slot, keep: bool = False) -> None:
        """Free the slot's rows; rows no sample uses any more are dropped (a long cache's must not linger). `keep`:
        the cache lives on (a follow-up request feeds it), so its layers leave the rows as plain layers."""
        layers = slot.run.cache.layers
        for i, layer in enumerate(layers):
            if isinstance(layer, EvictingLayer):  # its scores go back to its evictor's state
                slot.decode_hook.state.scores[i] = layer.row_scores()
            if isinstance(layer, RowLayer):
                if keep:
                    layers[i] = layer.detach()
                    if isinstance(layer, EvictingLayer):
                        slot.decode_hook.state.layers[i] = layers[i]
                else:
                    layer.release()
        self.rows = {key: rows for key, rows in self.rows.items() if any(o is not None for o in rows.owners)}

    @staticmethod
    def _try(step, *args):
        """`step(*args)`, or the exception it raised: a sample's own failure (e.g. a NaN distribution to sample
        from, a token its tokenizer cannot decode) ends that sample only."""
        try:
            return step(*args)
        except Exception as e:  # noqa: BLE001 - reported to the caller as this sample's outcome
            return e

    def _choose(self, slot: Slot) -> Tensor | None:
        """The slot's next token `[1, 1]` (left on the device); None when the
        sample has generated all it may."""
        request, logits = slot.request, slot.logits
        if request.cancelled:
            slot.stop_reason = "cancelled"
            return None
        if slot.t >= request.max_new_tokens:
            return None
        if request.beams is not None:  # (its search ends before the length when every beam has finished)
            token = request.beams.choose(logits, slot.t, slot.run)
            slot.stop_reason = "eos" if token is None else slot.stop_reason
            return token
        if request.on_logits is not None:
            request.on_logits(slot.t, logits)
        if request.forced is not None:  # the token rule of a teacher-forced stream; after its last, it ends
            if slot.t >= len(request.forced):
                return None
            return torch.tensor([[request.forced[slot.t]]], device=logits.device)
        enders = self.eos_ids | set(request.stop_token_ids)
        if slot.t < request.min_new_tokens and enders:
            logits = logits.clone()
            logits[:, sorted(enders)] = float("-inf")
        return next_token(logits, slot.decoding.sampling, slot.generator)

    def _accept(self, slot: Slot, value: int) -> bool:
        """Take the chosen token's id; False when the sample ends with it (EOS, a stop string, the length)."""
        request = slot.request
        slot.t += 1
        if request.beams is not None:  # (its rule reads its tokens itself and says when the search ends)
            return True
        if request.forced is not None:
            slot.tokens.append(value)
            return True
        if value in self.eos_ids or value in request.stop_token_ids:
            slot.stop_reason = "eos" if value in self.eos_ids else "stop"
            return False
        slot.tokens.append(value)
        if request.stop and self.tokenizer is not None:
            slot.text = self.tokenizer.decode(slot.tokens, skip_special_tokens=True)
            cut = min((slot.text.find(s) for s in request.stop if s in slot.text), default=-1)
            if cut >= 0:
                slot.text, slot.stopped, slot.stop_reason = slot.text[:cut], True, "stop"
                return False
        return slot.t < request.max_new_tokens

    def _finish(self, slot: Slot) -> Generation:
        if slot.request.beams is not None:
            slot.tokens = slot.request.beams.best()
        if not slot.stopped:
            slot.text = self.tokenizer.decode(slot.tokens, skip_special_tokens=True) if self.tokenizer else ""
        return slot.run.finish(slot.tokens, slot.text, slot.n_forward, slot.decode_s, slot.stop_reason)

    # --- one batched forward ----------------------------------------------------------------------------------
    def _position(self, slot: Slot) -> int:
        """The new token's position: prompt_len + t (original), or right after the kept entries (shift)."""
        if slot.decoding.positions == "shift":
            cache = slot.run.cache
            position = cache.layers[0].keys.shape[-2]
            for layer in cache.layers:
                layer.next_position = position
            return position
        return slot.run.prompt_len + slot.t - 1

    @torch.no_grad()
    def _forward(self, stepping: list[tuple[Slot, Tensor]]) -> None:
        slots = [slot for slot, _ in stepping]
        device = stepping[0][1].device
        input_ids = torch.cat([token for _, token in stepping])  # a beam sequence brings a token per beam
        positions = torch.tensor([[self._position(slot)] * len(token) for slot, token in stepping],
                                 device=device).view(-1, 1)
        capture_name = self.model.config._attn_implementation
        if self.batch_size == 1:  # a batch of one: its own cache, the capture's attention and hooks as they are
            (slot,) = slots  # (every family, attention replaced or windowed included, decodes this way)
            past, attention = slot.run.cache, capture_name
            self.capture.cache = slot.run.cache  # its own hooks (a copied slot's are not those prepare left)
            self.capture.decode_hook, self.capture.input_hook = slot.decode_hook, slot.input_hook
            self.capture.logit_scale = slot.logit_scale
        else:
            past = self.cache = BatchedCache(slots)
            attention = self.name
            if any(slot.input_hook is not None for slot in slots):
                self.capture.input_hook = self._input_hook
        use_attention(self.model, attention)
        t0 = time.perf_counter()
        try:
            with without_cudnn_attention():
                logits = self.model(input_ids=input_ids, past_key_values=past, position_ids=positions,
                                    use_cache=True).logits[:, -1]
            if self.batch_size > 1:
                past.write_back()
        finally:
            use_attention(self.model, capture_name)
            if self.batch_size > 1:
                self.capture.reset()
            self.cache = None
        if logits.is_cuda:  # the next token's .item() would wait anyway; waiting here makes the time right
            torch.cuda.synchronize(logits.device)
        seconds = time.perf_counter() - t0
        for i, slot in enumerate(slots):
            slot.logits = logits if self.batch_size == 1 else logits[i:i + 1]
            slot.n_forward += 1
            slot.decode_s += seconds

    def _input_hook(self, layer_idx: int, hidden: Tensor, position_embeddings: tuple[Tensor, Tensor]) -> None:
        """Before each layer's attention: the samples' own prefetch hooks (TailorKV) on their rows; hooks of one
        type with a `together` (one call for several samples' rows) run in one call."""
        cos, sin = position_embeddings
        groups: dict = {}
        for i, slot in enumerate(self.cache.slots):
            if slot.input_hook is not None:
                groups.setdefault(getattr(slot.input_hook, "together", None), []).append(i)
        for together, rows in groups.items():
            if together is not None:
                together([self.cache.slots[i].input_hook for i in rows], layer_idx, rows_of(hidden, rows),
                         (rows_of(cos, rows), rows_of(sin, rows)))
                continue
            for i in rows:
                self.capture.cache = self.cache.slots[i].run.cache
                self.cache.slots[i].input_hook(layer_idx, hidden[i:i + 1], (cos[i:i + 1], sin[i:i + 1]))

    def _attention(self, module, query: Tensor, key: Tensor, value: Tensor, attention_mask, **kwargs):
        """The batched forward's attention function: one call per set of shared rows (every sample whose layer sits
        in them), and one call of the engine's decode attention for all the others (`_attend_together`); a lone
        other sample takes batch 1's path."""
        capture_fn = ALL_ATTENTION_FUNCTIONS[self.capture.name]
        layer_idx, batch = self.capture.slots[module.layer_idx], query.shape[0]
        outputs: list[Tensor | None] = [None] * batch
        shared: dict[int, tuple[Rows, list[tuple[int, int]]]] = {}
        for i, slot in enumerate(self.cache.slots):
            layer = slot.run.cache.layers[layer_idx]
            if isinstance(layer, RowLayer):
                shared.setdefault(id(layer.rows), (layer.rows, []))[1].append((i, layer.row))
        for rows, members in shared.values():
            self.capture.cache = self.cache.slots[members[0][0]].run.cache
            n_rows, slot_idx, row_idx = len(rows.owners), *map(list, zip(*members))
            in_order = slot_idx == row_idx == list(range(batch)) and n_rows == batch  # the batch is the rows
            if isinstance(rows, EvictingRows):  # one engine call over the rows as they lie, then one eviction
                out, logits = decode_attention(query if in_order else scattered(query, slot_idx, row_idx, n_rows),
                                               [DecodeKV(*attended(module, rows.keys, rows.values))],
                                               kwargs.get("scaling") or
                                               module.scaling, softcap=kwargs.get("softcap"), sinks=sinks_of(kwargs),
                                               return_logits=True)
                EvictionState.decode_rows(rows, layer_idx, logits)
            elif rows.pool is not None:  # per-head variable layers: one engine call over the pool's padded block
                scale = kwargs.get("scaling") or module.scaling
                out = decode_attention(query if in_order else scattered(query, slot_idx, row_idx, n_rows),
                                       [rows.pool.decode_kv()], scale, softcap=kwargs.get("softcap"),
                                       sinks=sinks_of(kwargs))[0]
            elif in_order:
                out = capture_fn(module, query, *attended(module, *rows.attention_inputs()), **kwargs)[0]
            else:
                out = capture_fn(module, scattered(query, slot_idx, row_idx, n_rows),
                                 *attended(module, *rows.attention_inputs()),
                                 **{k: scattered(v, slot_idx, row_idx, n_rows) if per_row(v, batch) else v
                                    for k, v in kwargs.items()})[0]
            for i in slot_idx:  # compression while decoding: after this step's attention, in the row's place
                if self.cache.slots[i].decode_hook is not None and not isinstance(rows, EvictingRows):
                    self.cache.slots[i].decode_hook(layer_idx, query[i:i + 1], None,
                                                    kwargs.get("scaling") or module.scaling)
            if in_order:
                return out, None
            for i, r in members:
                outputs[i] = out[r:r + 1]
        others = [i for i in range(batch) if outputs[i] is None]
        if len(others) == 1:  # one sample: batch 1's own path, the capture's function over its cache
            outputs[others[0]] = self._attend_alone(capture_fn, module, query, others[0], kwargs)
        elif others:
            self._attend_together(module, query, others, kwargs, outputs)
        return torch.cat(outputs), None

    def _attend_alone(self, capture_fn, module, query: Tensor, i: int, kwargs: dict) -> Tensor:
        batch, slot = query.shape[0], self.cache.slots[i]
        keys, values = attended(module, *self.cache.updated[self.capture.slots[module.layer_idx]][i])
        self.capture.cache, self.capture.decode_hook = slot.run.cache, slot.decode_hook
        self.capture.logit_scale = slot.logit_scale
        try:
            return capture_fn(module, query[i:i + 1], keys, values, None,
                              **{k: v[i:i + 1] if per_row(v, batch) else v for k, v in kwargs.items()})[0]
        finally:
            self.capture.decode_hook = self.capture.logit_scale = None

    def _attend_together(self, module, query: Tensor, members: list[int], kwargs: dict,
                         outputs: list[Tensor | None]) -> None:
        """Samples `members` (not in shared rows) attend in one call of the engine's decode attention, whatever
        their layers hold (dense, per-head variable, quantized, offloaded) and however long; each sample's
        temperature scales its own logits, and a decode-time evictor scores the logits this call computed."""
        layer_idx, window = self.capture.slots[module.layer_idx], kwargs.get("sliding_window")
        scaling = kwargs.get("scaling") or module.scaling
        queries = query if len(members) == query.shape[0] else rows_of(query, members)
        kvs: list[DecodeKV | None] = [None] * len(members)
        by_type: dict[type, list[int]] = {}  # layers with their own storage, asked once per type
        for j, i in enumerate(members):
            layer = self.cache.slots[i].run.cache.layers[layer_idx]
            if layer.own_storage:
                refuse_window(layer, window)
                by_type.setdefault(type(layer), []).append(j)
            else:  # what its update returned (keys at their slots under pos-shift)
                kvs[j] = DecodeKV(*attended(module, *self.cache.updated[layer_idx][i]), None,
                                  layer.attention_positions())
        for kind, js in by_type.items():
            layers = [self.cache.slots[members[j]].run.cache.layers[layer_idx] for j in js]
            for j, kv in zip(js, kind.decode_kv_many(layers, rows_of(queries, js))):
                kvs[j] = kv
        scales = []
        for j, i in enumerate(members):
            slot = self.cache.slots[i]
            n_keys = kvs[j].keys.shape[-2]
            scales.append(scaling * slot.logit_scale(n_keys) if slot.logit_scale is not None else scaling)
        hooked = [j for j, i in enumerate(members) if self.cache.slots[i].decode_hook is not None]
        out, logits = decode_attention(queries, kvs, scales, softcap=kwargs.get("softcap"), window=window,
                                       sinks=sinks_of(kwargs), return_logits=bool(hooked))
        for j, i in enumerate(members):
            outputs[i] = out[j:j + 1]
        groups: dict = {}  # (they may evict: this step already attended)
        for j in hooked:
            groups.setdefault(getattr(self.cache.slots[members[j]].decode_hook, "together", None), []).append(j)
        for together, js in groups.items():
            own = [logits[j:j + 1, :, None, :kvs[j].keys.shape[-2]] for j in js]
            if together is not None:  # hooks of one type that score several samples in one call
                together([self.cache.slots[members[j]].decode_hook for j in js], layer_idx,
                         [kvs[j].keys for j in js], own)
                continue
            for j, row in zip(js, own):
                self.cache.slots[members[j]].decode_hook(layer_idx, queries[j:j + 1], kvs[j].keys, scales[j],
                                                         logits=row)


def use_attention(model, name: str) -> None:
    """Route the model's attention to `name`. transformers' `set_attn_implementation` walks every module (about 2 ms
    a call on SmolLM2's 30 layers, 7 % of a 60 ms CPU decode step for the two calls a step made), so it is skipped
    when `name` is already set: a batch of one steps on the capture's own function."""
    if model.config._attn_implementation != name:
        model.set_attn_implementation(name)


def per_row(value, batch: int) -> bool:
    """An attention kwarg with one entry per sample of the batch (e.g. position_ids)."""
    return isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == batch


def rows_of(tensor: Tensor, rows: list[int]) -> Tensor:
    """Rows `rows` of `tensor`, in that order."""
    if rows == list(range(tensor.shape[0])):
        return tensor
    if len(rows) == 1:
        return tensor[rows[0]:rows[0] + 1]
    return tensor.index_select(0, index_of(tuple(rows), tensor.device))


def scattered(tensor: Tensor, slot_idx: list[int], row_idx: list[int], n_rows: int) -> Tensor:
    """The batch's rows `slot_idx` of `tensor` placed at rows `row_idx` of an `n_rows` tensor (the others zero)."""
    return tensor.new_zeros(n_rows, *tensor.shape[1:]).index_copy_(0, index_of(tuple(row_idx), tensor.device),
                                                                   rows_of(tensor, slot_idx))


@functools.lru_cache(maxsize=1024)
def index_of(rows: tuple[int, ...], device: torch.device) -> Tensor:
    """`rows` as an index tensor on `device`, made once per set of rows (a set lasts until a sample joins or leaves),
    so the step does not copy an index from the host to the device each time; one `index_select` replaces a slice
    and a copy per row."""
    return torch.tensor(rows, device=device)


class PrefilledOnce(BatchedDecoder):
    """For benchmarks: prefills each prompt (by `Request.tag`) the first time it joins; later joins decode from a
    copy of that compressed cache (its method state and hooks copied with it), so decode speed can be measured at
    several batch sizes without re-prefilling. `join_s` / `join_cpu_s`: the wall / process CPU time spent joining."""

    def __init__(self, *args, memo: dict, **kwargs):
        super().__init__(*args, **kwargs)
        self.memo, self.join_s, self.join_cpu_s = memo, 0.0, 0.0

    def _join(self, request: Request) -> Slot:
        t0, c0 = time.perf_counter(), time.process_time()
        if request.tag not in self.memo:
            self.memo[request.tag] = super()._join(request)
        original = self.memo[request.tag]
        shared = (original.decoding, original.decoding.method, self.capture, self.model)  # not copied
        slot = copy.deepcopy(original, {id(original.request): request, **{id(x): x for x in shared}})
        self.join_s += time.perf_counter() - t0
        self.join_cpu_s += time.process_time() - c0
        return slot


def generate_batched(model, tokenizer, method: Method, capture: AttentionCapture, requests: Iterable[Request],
                     batch_size: int, sampling: Sampling = Sampling(), positions: str = "original",
                     eos_ids: set[int] | None = None, compress_after: str = "layer",
                     recompress: DecodeCompression = DecodeCompression(),
                     ) -> Iterator[tuple[Request, Generation | Exception]]:
    """`generate` for many prompts, `batch_size` decoding at once; yields (request, generation) in completion
    order, or (request, exception) for a sample that failed. `capture` must be active on `model`."""
    decoder = BatchedDecoder(model, tokenizer, method, capture, batch_size, sampling, positions, eos_ids,
                             compress_after, recompress)
    yield from decoder.run(requests)


def generate(model, tokenizer, method: Method, capture: AttentionCapture, input_ids: Tensor,
             budget: int | None, max_new_tokens: int, stop: tuple[str, ...] = (),
             sampling: Sampling = Sampling(), eos_ids: set[int] | None = None, on_logits=None,
             positions: str = "original", seed: int = 0, stop_token_ids: tuple[int, ...] = (),
             min_new_tokens: int = 0, compress_after: str = "layer",
             prefilled: Prefilled | None = None, question_len: int = 0,
             recompress: DecodeCompression = DecodeCompression()) -> Generation:
    """One prompt end to end: a batch of one through the engine, with timings and the cache's accounting.
    `capture` must be active on `model`. A failure raises (batches report it per sample instead).

    `positions`: "original" (kept keys keep their RoPE positions; token t at prompt_len + t) or "shift" (attention
    sees the kept keys at consecutive cache slots, exactly rotated from the stored ones; StreamingLLM/BUZZ pos-shift).
    `seed` seeds per-sample randomness of a method (Keyformer's Gumbel noise). `on_logits(t, logits)` sees each
    step's logits. `compress_after`, `prefilled`, `question_len` and `recompress`: see `generation.prepare`."""
    request = Request(input_ids, budget, max_new_tokens, tuple(stop), tuple(stop_token_ids), min_new_tokens, seed,
                      prefilled=prefilled, on_logits=on_logits, question_len=question_len)
    return run_alone(BatchedDecoder(model, tokenizer, method, capture, 1, sampling, positions, eos_ids,
                                    compress_after, recompress), request)


def decode(model, tokenizer, method: Method, capture: AttentionCapture, prepared: Prepared, max_new_tokens: int,
           eos_ids: set[int], stop: tuple[str, ...] = (), positions: str = "original",
           sampling: Sampling = Sampling()) -> Generation:
    """Decode a cache prefilled and compressed by hand (`Prepared.from_cache`, or `prepare`) through the engine;
    the caller keeps `prepared.cache` to look at afterwards. The decode hooks are those compression left on
    `capture`."""
    request = Request(None, None, max_new_tokens, tuple(stop), prepared=prepared)
    return run_alone(BatchedDecoder(model, tokenizer, method, capture, 1, sampling, positions, eos_ids), request)


def teacher_force(model, capture: AttentionCapture, prepared: Prepared, tokens: list[int],
                  on_logits: Callable[[int, Tensor], None], positions: str = "original") -> Generation:
    """Feed `tokens` one per step after a prepared cache (a teacher-forced stream: perplexity, lm-eval's
    loglikelihood) through the engine's step; `on_logits(t, logits)` sees the logits before `tokens[t]` is fed
    (t = 0: the prepared logits) and, last, those after `tokens[-1]` (t = len(tokens)). The decode hooks are those
    compression left on `capture`."""
    request = Request(None, None, len(tokens) + 1, prepared=prepared, on_logits=on_logits, forced=list(tokens))
    return run_alone(BatchedDecoder(model, None, None, capture, 1, positions=positions, eos_ids=set()), request)


def run_alone(decoder: BatchedDecoder, request: Request) -> Generation:
    ((_, outcome),) = decoder.run([request])
    if isinstance(outcome, Exception):
        raise outcome
    return outcome
