"""Compression while decoding, for every method that scores entries: `decode_compression.target=T` (and `.every=N`),
or `decode_compression.ratio=R` instead of a target.

A reasoning model writes thousands of tokens after a short prompt, so the cache grows while decoding and a prefill
selector (SnapKV, PyramidKV, KNorm, Expected Attention, StreamingLLM, ...) never sees most of it. kvpress's
`DecodingPress` answers this, and so does this hook, with its semantics and defaults: every `every` generated tokens
(`compression_interval`, 512) each layer longer than its target is compressed to it (`target_size`, 2048 there; per
layer the method's own `layer_budgets(n, layers, T)`, so PyramidKV keeps its pyramid), by the method's own `select`
over the layer as it is, with the last `query_window` generated tokens' queries as the observation window (kvpress
keeps a buffer of the last 256 hidden states and recomputes them; the queries are what a window scorer reads).
The window itself (the newest tokens) is kept, as at prefill. After a prefill compression to at most T, a layer so
never holds more than its share (T; SimLayerKV's lazy layers n_sink + T - n_last) + every entries per head: in
batched decoding that is the fixed capacity of its row (kvbench.cache.rows, compacted in place), where the method's
shares are uniform and no layer may be kept whole (SimLayerKV's non-lazy layers grow). Per-head variable methods
(Ada-KV, KVzip), decode-time evictors (they evict every step already), storage methods, threshold methods (DMS,
KVzap: per-head variable too), methods whose scores need what only a prefill's view holds (`Method.prefill_needs`:
every prompt query, W_o; kvpress's per-layer ratios, of the tokens seen), beam search and conversations are
refused by `check`, which names the methods that can.

`ratio=R` is kvpress's `CompressionRatioDecodingPress`: the same schedule, with the target at each compression
max(1, int(seen * (1 - R))) of the tokens seen so far (prompt and generated, the step's own included; kvpress's
`position_ids.max() + 1`), split over the layers by the same `layer_budgets`. Its target grows with the length, so
its layers stay out of batched decoding's fixed-capacity rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from kvbench.cache import KVCache
from kvbench.methods.base import Kind, LayerView, Method


@dataclass(frozen=True)
class DecodeCompression:
    """The `decode_compression` config node: off while `target` and `ratio` are both None; at most one is set."""

    every: int = 512  # generated tokens between two compressions (kvpress: compression_interval)
    target: int | None = None  # entries per head a layer is brought back to (kvpress: target_size, 2048)
    counted: Literal["generated", "sequence"] = "generated"  # every N generated tokens (kvpress), or whenever the
    # sequence, prompt included, reached a multiple of N on the previous step (R-KV's `length % divide_length`); then
    # the window's queries are the sequence's last ones too, the prompt's included (R-KV's query cache), where
    # kvpress's buffer holds the generated tokens' alone
    ratio: float | None = None  # instead of target: the fraction of the tokens seen (prompt and generated) removed,
    # the target then max(1, int(seen * (1 - ratio))) (kvpress: CompressionRatioDecodingPress)

    def __post_init__(self):
        if self.target is not None and self.ratio is not None:
            raise ValueError(f"decode_compression.target={self.target} and decode_compression.ratio={self.ratio}: "
                             "set one of them, the other null")

    @property
    def on(self) -> bool:
        return self.target is not None or self.ratio is not None

    @property
    def switch(self) -> str:
        """How the run turned it on, for messages: `decode_compression.target=40` or `decode_compression.ratio=0.5`."""
        return f"decode_compression.ratio={self.ratio}" if self.ratio is not None else \
            f"decode_compression.target={self.target}"

    def target_at(self, seen: int) -> int:
        """The target (mean entries per head over the layers) after `seen` tokens, the step's own included."""
        return max(1, int(seen * (1 - self.ratio))) if self.ratio is not None else self.target


def check(method: Method, setting: DecodeCompression, positions: str = "original", num_beams: int = 1,
          turns: int = 1) -> None:
    """One line naming what cannot compress while decoding, and the methods that can, before weights load."""
    if not setting.on:
        return
    why = why_not(method)
    if why:
        name = getattr(method, "registry_name", type(method).__name__)
        off = "decode_compression.ratio=null" if setting.ratio is not None else "decode_compression.target=null"
        raise ValueError(f"{setting.switch}: {name} {why}; methods that compress while decoding: "
                         f"{', '.join(decoding_methods())}; or {off}")
    if positions != "original" or num_beams > 1 or turns > 1:
        raise ValueError(f"{setting.switch} runs with positions=original, generation.num_beams=1 and one turn")
    if setting.target is not None:  # (a ratio's targets depend on the lengths: as a prefill ratio, unchecked here)
        method.check_budget(setting.target)  # e.g. SnapKV's window must fit in it


def why_not(method: Method) -> str | None:
    """Why `method` cannot compress while decoding, in a few words; None: it can."""
    if not method.compresses:
        return "keeps every entry"
    if method.kind is Kind.EVICTOR:
        return "evicts at every decode step already (its budget holds while decoding)"
    if getattr(method, "kv_bits", None) is not None:  # method=kivi, +method.quantize
        return "stores its layers quantized, from which nothing is evicted"
    if method.kind is not Kind.SELECTOR or method.own_storage:
        return "keeps per-head variable or offloaded layers, which decode-time compression does not rebuild yet"
    if method.threshold_budget:
        return ("keeps what its score threshold passes, in per-head variable layers, which decode-time compression "
                "does not rebuild yet")
    if method.prunes_channels:
        return "prunes key channels (key_channels), whose layers decode-time compression does not rebuild"
    if method.prefill_needs:
        return f"scores at prefill only: it needs {method.prefill_needs}, which a decoding layer's view does not hold"
    return None


def decoding_methods() -> list[str]:
    """The registered methods that compress while decoding with their defaults (the refusal names them)."""
    from kvbench.registry import METHODS

    names = []
    for name in METHODS.names():
        try:
            method = METHODS[name]()
        except (TypeError, ValueError):  # a method with a required field (a user's own) is left out of the list
            continue
        if why_not(method) is None:
            names.append(name)
    return names


def select(method: Method, view: LayerView, n_keep: int, cache: KVCache) -> Tensor | list[Tensor] | None:
    """The method's selection in layer `view.layer_idx` of `cache`; a method that `holds_ranked` (R-KV) is handed
    the ranking the layer's last selection left, and leaves its own."""
    if not method.holds_ranked:
        return method.select(view, n_keep)
    i = view.layer_idx
    idx, cache.ranked[i] = method.select_ranked(view, n_keep, cache.layers[i].positions, cache.ranked.get(i))
    return idx


def hold_decode_queries(capture, window: int, queries: dict[int, Tensor] | None = None) -> None:
    """Before a prefill: let `capture` hold each layer's last `window` queries of the prompt and fed chunks for the
    decode hook (0: none); `queries`: a shared prefill's, already there."""
    capture.decode_window = window
    capture.decode_queries = {i: q[:, :, -window:] for i, q in (queries or {}).items()} if window else {}


def take_decode_queries(capture) -> dict[int, list[Tensor]]:
    """What `hold_decode_queries` let the capture hold, one query per token, as `Recompressor.queries`."""
    held, capture.decode_window, capture.decode_queries = capture.decode_queries, 0, {}
    return {i: list(q.split(1, dim=2)) for i, q in held.items()}


@dataclass
class Recompressor:
    """The capture's decode hook of one sample: buffers each layer's last queries and compresses the layer every
    `every` steps. A plain object, so a prepared sample can be deep-copied (batched decoding, benchmarks)."""

    method: Method
    cache: KVCache
    setting: DecodeCompression
    softcap: dict[int, float]
    rotary: dict
    fixed: frozenset[int]  # sliding-window layers keep the model's own window semantics
    queries: dict[int, list[Tensor]] = field(default_factory=dict)  # layer -> the last query_window queries
    steps: dict[int, int] = field(default_factory=dict)  # layer -> decode steps seen
    compressions: int = 0

    def __call__(self, i: int, query: Tensor, key: Tensor, scaling: float, bias: Tensor | None = None,
                 logits: Tensor | None = None) -> None:
        if i in self.fixed:
            return
        window = self.method.query_window
        if window:
            held = self.queries.setdefault(i, [])
            held.append(query)
            del held[:-window]
        self.steps[i] = self.steps.get(i, 0) + 1
        count = self.steps[i] if self.setting.counted == "generated" else self.cache.layers[i].seen_tokens - 1
        if count % self.setting.every == 0:
            self.compress(i, scaling)

    def bound(self, n: int, new_tokens: int) -> int | None:
        """The most entries a layer holding `n` now can hold while `new_tokens` are decoded: its fixed capacity in
        batched decoding's rows (kvbench.cache.rows, compacted in place). None where the method's per-layer shares
        change with the length (PyramidKV's pyramid) or that may keep a layer whole (SimLayerKV's non-lazy layers,
        which grow with every token): such layers stay out of the rows and grow and shrink. The layers' share is
        the method's own (SimLayerKV's lazy layers: n_sink + target - n_last), not always the target."""
        if self.setting.ratio is not None:  # the target grows with the tokens seen
            return None
        shares = set(self.method.layer_budgets(1 << 30, len(self.cache.layers), self.setting.target))
        if len(shares) != 1 or self.method.may_keep_whole:
            return None
        return min(n + new_tokens, max(n, *shares) + self.setting.every)

    @torch.no_grad()
    def compress(self, i: int, scaling: float) -> None:
        layer, n_layers = self.cache.layers[i], len(self.cache.layers)
        n = layer.keys.shape[-2]
        # the layers' shares from the tokens seen so far, the same for every layer at this step (their lengths
        # differ: a pyramid's shares must come from one length, or their mean drifts off the target)
        seen = layer.seen_tokens
        n_keep = self.method.layer_budgets(seen, n_layers, self.setting.target_at(seen))[i]
        if n_keep >= n:
            return
        queries = torch.cat(self.queries[i], dim=2) if self.method.query_window else None
        view = LayerView(i, n_layers, layer.keys, layer.values, queries, scaling, None, self.softcap.get(i),
                         self.rotary.get(i), positions=layer.positions)  # (kept entries: not 0..n-1)
        idx = select(self.method, view, n_keep, self.cache)
        if idx is None:  # the method keeps this layer whole (SimLayerKV's non-lazy layers)
            return
        held = layer.nbytes()
        layer.keep(idx)  # dense layers only (`check`): the evicted entries are freed
        self.cache.note_peak(extra=held)  # the gather held the layer's old and new tensors at once
        self.compressions += 1
