"""TailorKV: 1-2-bit quantized dense-attention layers + offloaded sparse layers with top-k retrieval.

Nothing is evicted. After the (exact) prefill, each layer becomes one of two stores, fixed per model by an offline
identification (`kvbench.methods.tailorkv_layers`):
- quantization-friendly layers (`quant_layers`, shallow, dense attention): KIVI-style `bits`-bit keys per channel and
  values per token in groups of 64, with the official code's full-precision residual window of 128 tokens
  (`kvbench.cache.quantized.QuantizedLayer`);
- all others: the prompt K/V is offloaded to host memory; the device keeps `start_size` sinks, `recent_size` recent
  prompt tokens and every generated token, and each step fetches the top-(budget - start - recent) prompt tokens
  chosen by a `channels`-channel approximate score whose channels come from the next-layer query predicted from the
  previous layer's input (`kvbench.cache.offloaded.OffloadedLayer`).

`rest` (Table 1's ablation): `full` keeps the other layers at 16 bits (only `quant_layers` quantized), `quantized`
quantizes every layer (KIVI alone); the default `offload` is TailorKV.

Budget semantics (the paper's "64(+128)"): `budget` = sinks + recent + fetched top-k per KV head per sparse layer,
generated tokens excluded. LongBench: budget 192, start 8, recent 56, channels 8; RULER/InfiniteBench: budget 1024,
start 64, recent 64, channels 12. A storage method builds its own cache layers (`attach`), unlike the eviction
methods, whose choices `generation.compress` applies.

Tokens fed on top (`query=agnostic`'s question, a conversation's later turns) join each store as generated tokens do
and attend it in full: a quantized layer's past dequantized + the chunk in full precision, an offloaded layer's
whole prompt copied from the host (the ledger's `feed_bytes`) + generated and fed tokens; only the decode steps after
it retrieve (see `kvbench.cache.quantized` and `kvbench.cache.offloaded`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbench.cache.kv_cache import KVCache
from kvbench.cache.ledger import TransferLedger
from kvbench.cache.offloaded import OffloadedLayer
from kvbench.cache.quantized import QuantizedLayer
from kvbench.methods.base import Kind, Method
from kvbench.registry import METHODS

logger = logging.getLogger(__name__)


@dataclass
class Prefetch:
    """The capture's input hook of one sample: before each layer's attention, start the step's ledger (layer 0) and
    prefetch the next offloaded layer's channels from its predicted query. A plain object (not a closure), so a
    prepared sample can be deep-copied (with `capture` kept shared)."""

    layers: list
    ledger: TransferLedger
    capture: object
    predictable: frozenset[int]

    def __call__(self, layer_idx: int, hidden, position_embeddings) -> None:
        Prefetch.together([self], layer_idx, hidden, position_embeddings)

    def rebind(self, layers: list, ledger: TransferLedger) -> Prefetch:
        """This hook on a copy's layers and ledger (a conversation's `reset` turn decodes on a copy of the cache)."""
        return Prefetch(layers, ledger, self.capture, self.predictable)

    @staticmethod
    def together(hooks: list[Prefetch], layer_idx: int, hidden, position_embeddings) -> None:
        """The hooks of several samples (batched decoding), row i of `hidden` and of the (cos, sin) for `hooks[i]`:
        one query prediction for every sample that prefetches the next layer, then one channel choice
        (`OffloadedLayer.prefetch_many`), each sample fetching from its own layer."""
        if layer_idx == 0:
            for hook in hooks:
                hook.ledger.begin_step(sum(layer.nbytes() for layer in hook.layers))
        following = layer_idx + 1
        rows = [i for i, hook in enumerate(hooks)
                if following in hook.predictable and isinstance(hook.layers[following], OffloadedLayer)]
        if not rows:
            return
        if len(rows) < len(hooks):
            hidden = torch.cat([hidden[i:i + 1] for i in rows])
            if position_embeddings is not None:
                position_embeddings = tuple(torch.cat([x[i:i + 1] for i in rows]) for x in position_embeddings)
        query = hooks[rows[0]].capture.predict_query(following, hidden, position_embeddings)
        OffloadedLayer.prefetch_many([hooks[i].layers[following] for i in rows], query)


@METHODS.register("tailorkv")
@dataclass
class TailorKV(Method):
    bits: int = 1  # TailorKV-1 (LongBench tables) or TailorKV-2 (the RULER/InfiniteBench scripts' default)
    group_size: int = 64  # quantization group: tokens per key group, channels per value group
    residual: int = 128  # full-precision window of the official code (keys flush in blocks, values slide)
    start_size: int = 8  # sinks kept on the device (RULER/InfiniteBench: 64)
    recent_size: int = 56  # recent prompt tokens kept on the device (RULER/InfiniteBench: 64)
    channels: int = 8  # critical channels d_s per KV head for the approximate scores (RULER/InfiniteBench: 12)
    quant_layers: list[int] | None = None  # None: identify on the calibration prompt when the model is loaded
    rest: str = "offload"  # the layers outside quant_layers: offload (TailorKV), full (kept at 16 bits: Table 1's
    #                        rows quantizing only quant_layers), quantized (all layers quantized: Table 1's KIVI row)
    channel_query: str = "predicted"  # predicted: q̂ from the previous layer's input (paper); current: the layer's
    #                                   own query (an oracle ablation: exact channels, no one-layer-ahead prefetch)

    kind: ClassVar[Kind] = Kind.STORAGE
    own_storage: ClassVar[bool] = True
    takes_chunks: ClassVar[bool] = True  # a fed question or turn joins the stores as generated tokens do

    def __post_init__(self):
        if self.channel_query not in ("predicted", "current"):
            raise ValueError(f"tailorkv: channel_query={self.channel_query!r} is not one of predicted, current")
        if self.rest not in ("offload", "full", "quantized"):
            raise ValueError(f"tailorkv: rest={self.rest!r} is not one of offload, full, quantized")
        if self.bits not in (1, 2, 4, 8):
            raise ValueError(f"tailorkv: bits={self.bits!r} is not one of 1, 2, 4, 8 (the paper uses 1 and 2)")
        for name in ("group_size", "residual", "channels"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"tailorkv: {name}={getattr(self, name)!r} must be a positive integer")
        if self.start_size < 0 or self.recent_size < 0:
            raise ValueError("tailorkv: start_size and recent_size must be >= 0")
        if self.quant_layers is not None:
            if isinstance(self.quant_layers, str) or not all(isinstance(i, int) for i in self.quant_layers):
                raise ValueError(f"tailorkv: quant_layers={self.quant_layers!r} must be a list of layer indices "
                                 "(e.g. [0]; [] offloads every layer) or null (identify at load)")
            self.quant_layers = sorted(set(self.quant_layers))
        self.identification: dict | None = None

    @property
    def label(self) -> str:
        """The papers' name of this variant (TailorKV-1 / TailorKV-2), used in manifests and tables."""
        return f"tailorkv-{self.bits}"

    def check_budget(self, budget: int | None) -> None:
        super().check_budget(budget)
        if budget <= self.start_size + self.recent_size:
            raise ValueError(f"tailorkv: budget={budget} must exceed start_size + recent_size = "
                             f"{self.start_size + self.recent_size} (the top-k part is budget minus both)")

    def prepare(self, model, tokenizer, *, prefill=None) -> dict:
        """Once per run with the loaded model: identify the quantization-friendly layers if none were given, with
        the engine's `prefill`."""
        if self.quant_layers is None:
            from kvbench.methods.tailorkv_layers import identify_with_calibration

            if prefill is None:
                raise ValueError("tailorkv: identifying quant_layers runs a prefill; call prepare(model, tokenizer, "
                                 "prefill=kvbench.engine.generation.prefill), or set method.quant_layers")
            result = identify_with_calibration(model, tokenizer, prefill=prefill)
            self.quant_layers = result.quant_layers
            self.identification = {"scores": [round(x, 6) for x in result.scores],
                                   "source": "identified at load on the self-written calibration stand-in"}
            logger.info("tailorkv: identified quantization-friendly layers %s", self.quant_layers)
        return {"quant_layers": self.quant_layers, "identification": self.identification}

    def attach(self, cache: KVCache, capture, budget: int) -> TransferLedger:
        """Replace the prefilled layers by quantized / offloaded stores and hook the per-layer prefetch into the
        capture. Returns the ledger that counts every byte moved."""
        if self.quant_layers is None:
            raise ValueError("tailorkv: quant_layers is unknown; call prepare(model, tokenizer) first")
        n_layers, ledger = len(cache.layers), TransferLedger()
        outside = [i for i in self.quant_layers if not 0 <= i < n_layers]
        if outside:
            raise ValueError(f"tailorkv: quant_layers {outside} outside the model's layers 0..{n_layers - 1}")
        layers = cache.layers
        prompt_len = layers[0].keys.shape[-2]
        for i, layer in enumerate(layers):
            if i in capture.window_layers:  # a sliding-window layer keeps the model's own window semantics
                continue
            if i in self.quant_layers or self.rest == "quantized":
                layers[i] = QuantizedLayer.from_layer(layer, self.bits, self.group_size, self.residual)
            elif self.rest == "offload" and self.start_size + self.recent_size < prompt_len:  # else kept as it is
                layers[i] = OffloadedLayer.from_layer(layer, self.start_size, self.recent_size,
                                                      budget - self.start_size - self.recent_size, self.channels,
                                                      ledger)

        predictable = {i for i in range(1, n_layers) if capture.can_predict(i) and self.channel_query == "predicted"}
        unpredictable = [i for i in range(1, n_layers)
                         if i not in predictable and isinstance(layers[i], OffloadedLayer)]
        if self.channel_query == "predicted" and unpredictable:
            logger.warning("tailorkv: layers %s follow a layer with another position encoding; they pick channels "
                           "from their own query", unpredictable)

        capture.input_hook = Prefetch(layers, ledger, capture, frozenset(predictable))
        capture.cache = cache
        return ledger
