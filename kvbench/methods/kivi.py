"""KIVI (Liu et al., ICML 2024, arXiv 2402.02750): every layer's KV cache quantized to `bits`, nothing evicted.
Reference code: jy-yuan/KIVI @876b4d2 (`quant/new_pack.py`, `models/llama_kivi.py`).

Keys are quantized per channel in groups of `group_size` tokens, values per token in groups of `group_size`
channels; the most recent tokens stay in full precision (`residual`): at prefill the first n - n % residual keys and
all but the last `residual` values are quantized; while decoding, a full block of `residual` keys is quantized at
once and the oldest value leaves the window each step (`kvbench.cache.quantized.QuantizedLayer`, shared with
TailorKV's quantized layers; codes packed into real bytes by `kvbench.cache.quantizer`). The goldens in
tests/unit/test_quantizer_kivi.py come from running the reference's quantizer on the same tensors.

Defaults follow the reference's example (`example.py`: 2 bits, group 32; residual 128 as in the paper's runs,
`example.py` uses 32). Quirks and their switches:
- `arithmetic=kivi` (default): every quantization step in the cache's dtype, scale and zero stored in it (fp16 in the
  reference's runs, fp32 for the embedded model on a CPU, which doubles their bytes); `arithmetic=tailorkv`: TailorKV's
  rule (fp32 math, fp16 scale and zero), with which `bits=1 group_size=64` is TailorKV Table 1's "1-bit (KIVI)" row
  (`method=tailorkv method.rest=quantized`), number for number.
- the reference packs 2, 4 or 8 bits; `bits=1` is TailorKV's 1-bit extension of the same code.
- decode attention reads the layer dequantized to fp32 (the reference's fused dequant-GEMV CUDA kernel is not
  reimplemented); a constant group (the reference divides by zero) dequantizes to its min.
`budget` is not used (every token is kept); it only names the run directory, as for `full`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvbench.cache.kv_cache import KVCache
from kvbench.cache.ledger import StepStart, TransferLedger
from kvbench.cache.quantized import QuantizedLayer
from kvbench.cache.quantizer import ARITHMETIC, BITS
from kvbench.methods.base import Kind, Method
from kvbench.registry import METHODS


def check_quantizer(owner: str, bits: int, group_size: int, residual: int, arithmetic: str) -> None:
    """One-line errors for a quantized store's settings (method=kivi, `+method.quantize`), before weights load."""
    if bits not in BITS:
        raise ValueError(f"{owner}: bits={bits!r} is not one of {', '.join(map(str, BITS))}")
    if arithmetic not in ARITHMETIC:
        raise ValueError(f"{owner}: arithmetic={arithmetic!r} is not one of {', '.join(ARITHMETIC)}")
    for name, value in (("group_size", group_size), ("residual", residual)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{owner}: {name}={value!r} must be a positive integer")
    if residual % group_size or group_size % (8 // bits):
        raise ValueError(f"{owner}: residual={residual} must be a multiple of group_size={group_size}, and "
                         f"group_size a multiple of {8 // bits} ({bits}-bit codes packed into bytes)")


@METHODS.register("kivi")
@dataclass
class KIVI(Method):
    bits: int = 2  # 2 (KIVI-2) or 4 (KIVI-4); 1: TailorKV's table; 8 also packs
    group_size: int = 32  # tokens per key group (per channel), channels per value group (per token)
    residual: int = 128  # recent tokens kept in full precision (keys flush in blocks of it, values slide)
    arithmetic: str = "kivi"  # kivi: the reference's (the cache's dtype); tailorkv: fp32 math, fp16 scale/zero

    kind: ClassVar[Kind] = Kind.STORAGE
    own_storage: ClassVar[bool] = True
    takes_chunks: ClassVar[bool] = True  # a fed question or turn joins the residual as generated tokens do

    def __post_init__(self):
        check_quantizer("kivi", self.bits, self.group_size, self.residual, self.arithmetic)

    @property
    def label(self) -> str:
        """The papers' name of this variant (KIVI-2, KIVI-4), used in manifests and tables."""
        return f"kivi-{self.bits}"

    @property
    def kv_bits(self) -> int:
        """Bits per stored code (reports' `bits` column)."""
        return self.bits

    def check_budget(self, budget: int | None) -> None:
        if budget is not None:  # ignored (nothing is evicted), but a nonsensical value is still a mistake
            super().check_budget(budget)

    def attach(self, cache: KVCache, capture, budget: int | None) -> TransferLedger:
        """Replace every prefilled layer by its quantized store (sliding-window layers keep the model's window).
        Nothing moves between devices; the ledger only opens each decode step's entry."""
        layers, ledger = cache.layers, TransferLedger()
        for i, layer in enumerate(layers):
            if i not in capture.window_layers:
                layers[i] = QuantizedLayer.from_layer(layer, self.bits, self.group_size, self.residual,
                                                      self.arithmetic)
        capture.input_hook = StepStart(layers, ledger)
        capture.cache = cache
        return ledger
