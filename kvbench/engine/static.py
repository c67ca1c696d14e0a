"""The static decode step: each sequence's compressed cache in static-capacity rows, one step of shapes that never change.

gpt-fast's shape, over compressed caches. When a sequence joins, each of its layers moves into rows of a fixed
capacity (`kvbench.cache.static`): its kept entries plus room for every token it may still decode, rounded up to a
bucket (an evictor's rows hold its budget plus the step's token). A step then runs embeddings -> layers -> logits
with every length, validity mask and position on the device: a token is written to its head's first free slot,
attention masks what is not valid, a decode-time evictor scores the step's logits and clears the slot it evicts, and
the greedy token is chosen, all without a host sync; the host reads the chosen tokens once per step, for every
sequence (stop strings, EOS and lengths are checked there, as in `kvbench.engine.batching`). Shapes depend only on
(rows, capacity per layer), so `torch.compile(fullgraph=True)` captures the step once and replays it (CUDA graphs on
a GPU); on the CPU the same step runs eagerly unless `compile` is asked for.

What moves in: dense layers (selectors: full, StreamingLLM, SnapKV, PyramidKV, ...), per-head variable layers
(Ada-KV, KVzip: per-head validity over a padded capacity), decode-time evictors whose rule reads of the per-sample
state only its budget (H2O, TOVA, the rolling windows) and retrieval layers (Quest's pages, PQCache's codes: rows of
their own, `kvbench.cache.static_retrieval`, the retrieval a mask chosen on the device). What does not
(`unsupported` says why, and such runs decode eagerly): beam search, teacher forcing, pos-shift, compression while
decoding, sliding-window or replaced attention (ALiBi families), TailorKV's quantized and offloaded layers, and
Keyformer's shared score across layers (`score=shared`). Evictors whose rule keeps per-sample state run their
static forms (`kvbench.engine.static_eviction`: Keyformer's noise and schedule, BUZZ's sample count and log n).

Equality with the eager step: the same entries are attended with the same math (fp32 softmax; in fp32 models the
products too), in slot order rather than cache order, so sums round differently (~1e-7 in fp32) and a greedy argmax
or an evictor's choice can flip only where two candidates are that close (tests/unit/test_compiled_step.py).
"""
from __future__ import annotations

import time

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from kvbench.cache import static_retrieval
from kvbench.cache.kv_cache import KVLayer
from kvbench.cache.ledger import StepStart
from kvbench.cache.static import StaticRows, capacity_bucket
from kvbench.engine.batching import BatchedDecoder, Slot
from kvbench.engine.generation import EvictionHook
from kvbench.engine.static_eviction import BudgetRule, static_form
from kvbench.methods.base import Kind, Method


RETRIEVAL = ("quest", "pqcache")  # storage methods whose layers have static rows (kvbench.cache.static_retrieval)


def unsupported(method: Method, positions: str = "original", decode_compression: bool = False,
                num_beams: int = 1, model=None) -> str | None:
    """Why this configuration cannot decode through the static step, or None when it can."""
    name = getattr(method, "registry_name", type(method).__name__)
    if num_beams > 1:
        return "beam search reorders its rows every step"
    if positions != "original":
        return "positions=shift re-rotates keys to their slots"
    if decode_compression or method.own_decode_compression(1) is not None:
        return "compression while decoding rebuilds the layers"
    if method.prunes_channels:
        return "key channels pruned (key_channels) are stored in their own layout"
    if method.kind is Kind.STORAGE and name not in RETRIEVAL:
        return f"{name} keeps layers with their own storage"
    if getattr(method, "merges_values", False):
        return f"{name} merges leaving entries' values into kept ones, a write the static rows do not make"
    if method.kind is Kind.EVICTOR and method.evicts_while_decoding and static_form(method) is None:
        return f"{name}'s eviction rule decides across layers or keeps per-sample state"
    if model is not None:
        config = model.config.get_text_config()
        if getattr(config, "sliding_window", None) or "sliding_attention" in (getattr(config, "layer_types", None)
                                                                              or ()):
            return "sliding-window layers"
    return None


class StaticCache:
    """The `past_key_values` of a static step: writes each layer's new token into its rows (attention reads them
    there), at each row's position, for the active rows."""

    is_compileable = True

    def __init__(self, layers: list[StaticRows], rows: int, device: torch.device):
        self.layers = layers
        self.position = torch.zeros(rows, dtype=torch.long, device=device)  # the next token's position, per row
        self.active = torch.zeros(rows, dtype=torch.bool, device=device)
        self.is_sliding = [False] * len(layers)
        self.held_peak = torch.zeros(rows, dtype=torch.long, device=device)  # each row's K/V bytes per step: peak
        self.held_sum = torch.zeros(rows, dtype=torch.long, device=device)  # and sum (`KVCache.note_step`)

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        self.layers[layer_idx].write(key_states, value_states, self.position, self.active)
        if layer_idx == len(self.layers) - 1:  # once every layer holds its token, as the eager cache counts
            held = sum(static_retrieval.held_nbytes(rows) for rows in self.layers)
            self.held_peak.copy_(torch.maximum(self.held_peak, held))
            self.held_sum.add_(held * self.active.long())
        return key_states, value_states  # placeholders: the attention reads the rows

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.layers[layer_idx].capacity, 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


class StaticDecoder(BatchedDecoder):
    """Continuous batching (`BatchedDecoder`'s loop: joins, token rules, stops, records) over the static step.
    `compile`: capture the step (on CUDA: recorded into a CUDA graph, `GraphStep`; elsewhere, or with a `backend`:
    `torch.compile(fullgraph=True)`, inductor by default)."""

    def __init__(self, *args, compile: bool = False, backend: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        reason = unsupported(self.method, self.decoding.positions, self.decoding.recompress.on, model=self.model)
        if reason is not None:
            raise ValueError(f"step=static: {reason}; use step=eager")
        if self.capture is not None and (self.capture.adapter.replaces is not None or self.capture.window_layers):
            raise ValueError("step=static: attention outside transformers' AttentionInterface; use step=eager")
        if self.capture is not None and self.capture.hybrid:
            raise ValueError(f"step=static: {self.capture.adapter.family} is a hybrid model (recurrent state beside "
                             "attention), which the static step does not carry; use step=eager")
        self.compile, self.backend = compile, backend
        self.static_name = f"{self.name}_static"
        self.cache_static: StaticCache | None = None
        self.row_of: dict[int, int] = {}  # id(slot) -> its row
        self.slots_of: list[Slot | None] = [None] * self.batch_size
        self.evictor: BudgetRule | None = None
        self.step_fn = None
        self.greedy_of: dict[int, Tensor] = {}  # id(slot) -> its row of the last step's greedy tokens
        self.greedy: Tensor | None = None
        self.step_seconds: list[float] = []  # each step's wall time (benchmarks: the steady state after capture)

    # --- rows ---------------------------------------------------------------------------------------------------
    def _into_rows(self, slot: Slot) -> Slot:
        if slot.request.beams is not None or slot.request.forced is not None:
            raise ValueError("step=static: beam search and teacher forcing decode with step=eager")
        hook, layers = slot.decode_hook, slot.run.cache.layers
        if isinstance(slot.input_hook, StepStart):  # (retrieval: its ledger's steps are settled as it leaves)
            slot.input_hook = self.capture.input_hook = None
        if slot.input_hook is not None or (
                hook is not None and not isinstance(hook, EvictionHook)):
            raise ValueError("step=static: this sample's method hooks the step; use step=eager")
        if not all(static_retrieval.convertible(layer) for layer in layers):
            raise ValueError("step=static: a layer with its own storage; use step=eager")
        evicting = isinstance(hook, EvictionHook)
        if evicting:
            if self.evictor is None:
                config = self.model.config.get_text_config()
                self.evictor = static_form(hook.state.method)(hook.state.method, hook.state.budget, self.batch_size,
                                                              len(layers), config.num_attention_heads,
                                                              slot.run.logits.device)
            elif hook.state.budget != self.evictor.budget:
                raise ValueError("step=static: samples of one batch share one evictor budget; use step=eager")
        if self.cache_static is None:
            self._make_rows(slot, evicting)
        row = self.slots_of.index(None)
        needs = [self._capacity(layer, slot, evicting) for layer in layers]
        if any(n > rows.capacity for n, rows in zip(needs, self.cache_static.layers)) or any(
                StaticRows.layout(layer) != self._layout(rows) or not static_retrieval.takes(rows, layer)
                for layer, rows in zip(layers, self.cache_static.layers)):
            self._regrow(needs, layers)
        if evicting:
            self.evictor.join(row, hook.state, layers)
        for i, (layer, rows) in enumerate(zip(layers, self.cache_static.layers)):
            rows.take(row, layer, hook.state.scores.get(i) if evicting else None)
        cache = self.cache_static
        cache.position[row] = slot.run.prompt_len
        cache.active[row] = True
        cache.held_peak[row] = 0
        cache.held_sum[row] = 0
        self.slots_of[row], self.row_of[id(slot)] = slot, row
        self.greedy_of.pop(id(slot), None)  # (an id the last step's rows may still name)
        return slot

    def _capacity(self, layer: KVLayer, slot: Slot, evicting: bool) -> int:
        """An evictor's rows: what its rule holds and the step's token; others: every entry and every token to
        decode."""
        if evicting:
            return self.evictor.capacity(slot.decode_hook.state, layer.keys.shape[-2])
        if static_retrieval.convertible(layer) and not StaticRows.convertible(layer):
            return static_retrieval.capacity(layer, slot.request.max_new_tokens)
        return capacity_bucket(layer.decode_kv().keys.shape[-2] + slot.request.max_new_tokens)

    @staticmethod
    def _layout(rows: StaticRows) -> tuple[int, int, int]:
        return rows.keys.shape[1], rows.keys.shape[-1], rows.repeat

    def _make_rows(self, slot: Slot, evicting: bool) -> None:
        layers, device = slot.run.cache.layers, slot.run.logits.device
        rows = [self._new_rows(layer, self._capacity(layer, slot, evicting), evicting) for layer in layers]
        self.cache_static = StaticCache(rows, self.batch_size, device)
        self.step_fn = None

    def _new_rows(self, layer: KVLayer, capacity: int, scored: bool, old: StaticRows | None = None) -> StaticRows:
        if (rows := static_retrieval.new_rows(layer, old, self.batch_size, capacity)) is not None:
            return rows
        heads, dim, repeat = StaticRows.layout(layer)
        return StaticRows(self.batch_size, heads, capacity, dim, layer.keys.dtype, layer.keys.device, repeat, scored)

    def _regrow(self, needs: list[int], layers: list[KVLayer]) -> None:
        """A sequence that does not fit the current rows: larger rows (a new capacity bucket, so a new capture),
        every held row copied over."""
        old = self.cache_static.layers
        for i, (need, layer) in enumerate(zip(needs, layers)):
            rows = old[i]
            if need <= rows.capacity and StaticRows.layout(layer) == self._layout(rows) and \
                    static_retrieval.takes(rows, layer):
                continue
            if any(s is not None for s in self.slots_of) and StaticRows.layout(layer) != self._layout(rows):
                raise ValueError("step=static: samples whose layers hold different head layouts; use step=eager")
            bigger = self._new_rows(layer, max(need, rows.capacity), rows.scores is not None, rows)
            if self._layout(bigger) == self._layout(rows):  # (rows of another layout hold no sequence)
                c = rows.capacity
                for name in ("keys", "values", "positions", "valid", "scores"):
                    if getattr(rows, name) is not None:
                        getattr(bigger, name)[:, :, :c] = getattr(rows, name)
                static_retrieval.carry(rows, bigger)
            old[i] = bigger
        self.step_fn = None

    def _finish(self, slot: Slot):
        self._give_back(slot)  # (the record reads the layers' bytes and the decode steps')
        generation = super()._finish(slot)
        generation.step = "captured" if self.compile else "static"
        return generation

    def _leave_rows(self, slot: Slot, keep: bool = False) -> None:
        self._give_back(slot)

    def _give_back(self, slot: Slot) -> None:
        """The slot's layers as plain layers again (its cache lives on: a record, a next turn), its evictor's scores
        and step count, the bytes it held while decoding; its row is free."""
        row = self.row_of.pop(id(slot), None)
        self.greedy_of.pop(id(slot), None)
        if row is None:
            return
        cache, layers = self.cache_static, slot.run.cache.layers
        cache.active[row] = False
        state = slot.decode_hook.state if isinstance(slot.decode_hook, EvictionHook) else None
        static_retrieval.settle_ledger(slot.run.ledger, cache.layers, row, layers, slot.n_forward)
        for i, rows in enumerate(cache.layers):
            layer, scores = rows.give_back(row, layers[i])
            layer.seen_tokens = layers[i].seen_tokens + slot.n_forward
            layers[i] = layer
            if state is not None and scores is not None:
                state.scores[i], state.layers[i] = scores, layer
            rows.valid[row] = False
        if state is not None:
            self.evictor.leave(row, state)
        run_cache = slot.run.cache
        run_cache.decode_steps = slot.n_forward
        if slot.n_forward:
            peak, total = int(cache.held_peak[row]), int(cache.held_sum[row])
            run_cache.decode_peak_nbytes, run_cache.decode_sum_nbytes = peak, total
            run_cache.peak_nbytes = max(run_cache.peak_nbytes, peak)
        self.slots_of[row] = None

    # --- the step -----------------------------------------------------------------------------------------------
    def _attention(self, module, query: Tensor, key: Tensor, value: Tensor, attention_mask, **kwargs):
        rows = self.cache_static.layers[module.layer_idx]
        scaling = kwargs.get("scaling") or module.scaling
        if self.evictor is not None:
            scale = self.evictor.scale(module.layer_idx, rows, scaling)
        else:
            scale = torch.full((query.shape[0],), scaling, dtype=torch.float32, device=query.device)
        out, logits = rows.attend(query, scale, kwargs.get("softcap"), self.cache_static.active)
        if self.evictor is not None:
            self.evictor(module.layer_idx, rows, logits)
        return out, None

    def step(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """One decode step for every row: `tokens` `[R, 1]` -> the next-token logits `[R, V]` and the greedy token
        `[R, 1]`. Everything on the device: writes, masks, eviction, positions and the bytes each row holds."""
        cache = self.cache_static
        logits = self.model(input_ids=tokens, position_ids=cache.position[:, None], past_key_values=cache,
                            use_cache=True).logits[:, -1]
        cache.position.add_(cache.active.long())
        return logits, logits.argmax(dim=-1, keepdim=True)

    def _compiled(self):
        """The step as it runs: eager (`step=static`); on CUDA, recorded once into a CUDA graph and replayed (or
        compiled by `backend` first); elsewhere `torch.compile(fullgraph=True)` (inductor unless `backend`)."""
        if self.step_fn is None:
            if not self.compile:
                self.step_fn = self.step
            elif self.cache_static.position.is_cuda and self.backend is None:
                self.step_fn = GraphStep(self.step, self.batch_size, self.cache_static.position.device)
            else:
                kwargs = {"backend": self.backend} if self.backend else {}
                self.step_fn = torch.compile(self.step, fullgraph=True, dynamic=False, **kwargs)
        return self.step_fn

    @torch.no_grad()
    def _forward(self, stepping: list[tuple[Slot, Tensor]]) -> None:
        cache = self.cache_static
        if all(token is self.greedy_of.get(id(slot)) for slot, token in stepping):
            tokens = self.greedy  # every row took the step's own greedy token: no copy at all
        else:
            tokens = torch.zeros(self.batch_size, 1, dtype=torch.long, device=cache.position.device)
            for slot, token in stepping:
                tokens[self.row_of[id(slot)]] = token[0]
        if self.evictor is not None:
            self.evictor.before_step([self.row_of[id(slot)] for slot, _ in stepping], cache.layers)
        AttentionInterface.register(self.static_name, self._attention)
        AttentionMaskInterface.register(self.static_name, lambda *args, **kwargs: None)
        previous = self.model.config._attn_implementation
        self.model.set_attn_implementation(self.static_name)
        t0 = time.perf_counter()
        try:
            logits, self.greedy = self._compiled()(tokens)
        finally:
            self.model.set_attn_implementation(previous)
        if logits.is_cuda:
            torch.cuda.synchronize(logits.device)
        seconds = time.perf_counter() - t0
        self.step_seconds.append(seconds)
        self.greedy_of = {}
        for slot, _ in stepping:
            row = self.row_of[id(slot)]
            slot.logits = logits[row:row + 1]
            self.greedy_of[id(slot)] = self.greedy[row:row + 1]
            slot.n_forward += 1
            slot.decode_s += seconds

    def _choose(self, slot: Slot) -> Tensor | None:
        """The step's greedy token where the eager rule would pick the argmax of these logits (greedy, no forced
        token, no masked ends); otherwise the eager rule."""
        request, greedy = slot.request, self.greedy_of.get(id(slot))
        plain = (greedy is not None and not slot.decoding.sampling.do_sample and request.on_logits is None
                 and request.forced is None and request.beams is None and slot.t < request.max_new_tokens
                 and (slot.t >= request.min_new_tokens or not (self.eos_ids or request.stop_token_ids)))
        if plain:
            return greedy
        self.greedy_of.pop(id(slot), None)
        return super()._choose(slot)


class GraphStep:
    """The static step recorded into one CUDA graph and replayed: its first call runs the step eagerly (the warm-up:
    kernels chosen, workspaces made) and records it, later calls copy the tokens in and replay. Every buffer the step
    reads or writes keeps its address while the rows do (larger rows make a new `GraphStep`)."""

    def __init__(self, step, rows: int, device: torch.device):
        self.step, self.device = step, device
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: tuple[Tensor, Tensor] | None = None

    def __call__(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        if tokens is not self.tokens:
            self.tokens.copy_(tokens)
        if self.graph is not None:
            self.graph.replay()
            return self.out
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            logits, greedy = self.step(self.tokens)  # the real first step, and the warm-up
        torch.cuda.current_stream(self.device).wait_stream(stream)
        first = (logits.clone(), greedy.clone())
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):  # recorded, not run: the rows are not written twice
            self.out = self.step(self.tokens)
        return first

