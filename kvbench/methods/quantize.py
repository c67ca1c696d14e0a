"""`+method.quantize=kivi2`: what any selector keeps, stored KIVI-quantized (eviction and quantization combined).

    python -m kvbench.run method=snapkv budget=128 +method.quantize=kivi2
    python -m kvbench.run method=adakv budget=128 +method.quantize=kivi4 +method.quantize_residual=32

The wrapped selector picks its entries as it always does (SnapKV, PyramidKV, Ada-KV, StreamingLLM, ... and the other
switches: `merge`, `then`, `whole_layers`); right after each layer's selection, the kept entries are replaced by KIVI's
store (`kvbench.cache.quantized.QuantizedLayer`: keys per channel in groups of `quantize_group` kept entries, values
per entry in groups of channels, the last `quantize_residual` entries in full precision; the quantizer of
`kvbench.cache.quantizer` with the KIVI authors' arithmetic), so `kv_bytes` counts the packed codes, scales, zeros and
residual that are really held. A per-head variable selection (Ada-KV) gets one store per head
(`kvbench.cache.quantized_heads.QuantizedHeads`). The kept entries keep their original RoPE rotation; each next token
still gets position prompt_len + t. Records name the run `<method>+kivi2`.

Refused in one line (where their storage cannot take it): methods that evict again while decoding (H2O, TOVA, R-KV,
`decode_compression`: a quantized store drops nothing), storage methods (TailorKV, Quest: their own stores), ThinK's
channel-pruned keys, `positions=shift`, beam search, the static step; a fed chunk (`query=agnostic`, later turns)
after a per-head variable selection.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvbench.cache.kv_cache import KVLayer
from kvbench.cache.quantized import QuantizedLayer
from kvbench.cache.quantized_heads import QuantizedHeads
from kvbench.cache.varlen import VarlenLayer
from kvbench.methods.kivi import check_quantizer
from kvbench.methods.wrappers import Wrapper

SCHEMES = {"kivi1": 1, "kivi2": 2, "kivi4": 4, "kivi8": 8}  # `+method.quantize=<scheme>` -> bits


@dataclass
class Quantize(Wrapper):
    """The wrapped selector's kept entries stored at `bits` with a full-precision residual (module docstring)."""

    scheme: str = "kivi2"
    group_size: int = 32  # KIVI's default group
    residual: int = 128  # KIVI's full-precision window (the most recent kept entries)
    arithmetic: str = "kivi"
    suffix = "quant"
    own_storage: ClassVar[bool] = True  # no dense layer after it: nothing reorders, evicts or shares its rows

    def __post_init__(self):
        super().__post_init__()
        if self.scheme not in SCHEMES:
            raise ValueError(f"{self.registry_name}: quantize={self.scheme!r} is not one of {', '.join(SCHEMES)}")
        check_quantizer(self.registry_name, self.bits, self.group_size, self.residual, self.arithmetic)
        if self.press.prunes_channels:
            raise ValueError(f"{self.registry_name}: {self.press.registry_name} prunes key channels (key_channels), "
                             "whose layers +method.quantize cannot take; drop one of the two")

    @property
    def bits(self) -> int:
        return SCHEMES[self.scheme]

    @property
    def kv_bits(self) -> int:
        """Bits per stored code (reports' `bits` column)."""
        return self.bits

    @property
    def registry_name(self) -> str:
        return f"{getattr(self.press, 'registry_name', type(self.press).__name__)}+{self.scheme}"

    @property
    def takes_chunks(self) -> bool:
        return not self.press.own_storage  # a dense selection's store appends a chunk; per-head stores do not

    @property
    def prefill_needs(self) -> str | None:
        return self.press.prefill_needs or "a dense layer to select from (+method.quantize stores what it keeps " \
            "quantized, which nothing evicts from)"

    def stored_layer(self, layer: KVLayer) -> KVLayer:
        """The layer the selection left, quantized: dense -> `QuantizedLayer`, per-head -> `QuantizedHeads`."""
        layer = self.press.stored_layer(layer)
        if isinstance(layer, VarlenLayer):
            return QuantizedHeads.from_varlen(layer, self.bits, self.group_size, self.residual, self.arithmetic)
        if type(layer) is not KVLayer:
            raise ValueError(f"{self.registry_name}: {self.press.registry_name} left a {type(layer).__name__}, "
                             "which +method.quantize cannot store")
        return QuantizedLayer.from_layer(layer, self.bits, self.group_size, self.residual, self.arithmetic)
