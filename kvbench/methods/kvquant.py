"""KVQuant-style keys (Hooper et al., NeurIPS 2024, arXiv 2401.18079, "KVQuant: Towards 10 Million Context Length LLM
Inference with KV Cache Quantization"): every layer's prompt keys quantized per channel before RoPE, values per
token, both with dense-and-sparse outliers; nothing evicted (`kvbench.cache.kvquant`).

The authors' code (SqueezeAILab/KVQuant) and KVCache-Factory's `pyramidkv/quantcache.py` (@ c97f9d7: HQQ's quantizer
with a fixed ±6 outlier threshold, post-RoPE) need CUDA or the `hqq` package, so this is an independent
implementation of the paper's equations, checked against a direct recomputation of them in
tests/unit/test_kvquant.py. What it keeps of the paper: per-channel keys, pre-RoPE (the cache's post-RoPE keys are
rotated back with the layer's own angles, read at prefill, and rotated again when read), per-token values, 1%
outliers kept exactly (`outliers=0.01`: half the largest, half the smallest of each vector). What it does not: the
non-uniform datatypes (nuq: sensitivity-weighted k-means codebooks calibrated offline with Fisher information on a
calibration set) and the offline per-channel thresholds; the codes here are uniform (the shared quantizer) and the
thresholds are each vector's own, computed online. Per-vector attention-sink handling (q-norm, the first token in
fp16) is not done either. Generated and fed tokens stay full precision. `budget` is not used (every token is kept).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvbench.cache.kv_cache import KVCache
from kvbench.cache.kvquant import KVQuantLayer
from kvbench.cache.quantizer import BITS
from kvbench.methods.base import Kind, Method
from kvbench.registry import METHODS


@METHODS.register("kvquant")
@dataclass
class KVQuant(Method):
    bits: int = 4  # code bits (uniform here; the paper's nuq3/nuq4 are non-uniform)
    group_size: int = 64  # tokens per key group (per channel); channels per value group (per token)
    outliers: float = 0.01  # share of each vector kept exactly (dense-and-sparse); 0: none
    quantize_values: bool = True  # false: keys alone (KVQuant-style keys beside full-precision values)

    kind: ClassVar[Kind] = Kind.STORAGE
    own_storage: ClassVar[bool] = True
    takes_chunks: ClassVar[bool] = True  # a fed question joins each layer's full-precision part

    def __post_init__(self):
        if self.bits not in BITS:
            raise ValueError(f"kvquant: bits={self.bits!r} is not one of {', '.join(map(str, BITS))}")
        if not isinstance(self.group_size, int) or self.group_size < 1 or self.group_size % (8 // self.bits):
            raise ValueError(f"kvquant: group_size={self.group_size!r} must be a positive multiple of "
                             f"{8 // self.bits} ({self.bits}-bit codes packed into bytes)")
        if not 0 <= self.outliers < 1:
            raise ValueError(f"kvquant: outliers={self.outliers} must be in [0, 1)")

    @property
    def kv_bits(self) -> int:
        return self.bits

    def check_budget(self, budget: int | None) -> None:
        if budget is not None:  # ignored (nothing is evicted), but a nonsensical value is still a mistake
            super().check_budget(budget)

    def attach(self, cache: KVCache, capture, budget: int | None) -> None:
        """Replace every prefilled layer by its KVQuant store (sliding-window layers keep the model's window)."""
        layers = cache.layers
        for i, layer in enumerate(layers):
            if i not in capture.window_layers:
                if i not in capture.rotary:  # (never silently post-RoPE)
                    raise NotImplementedError(f"kvquant: layer {i}'s rotary angles were not recorded at prefill, so "
                                              "its keys cannot be taken back before RoPE")
                layers[i] = KVQuantLayer.from_layer(layer, capture.rotary[i], self.bits, self.group_size,
                                                    self.outliers, self.quantize_values)
        capture.cache = cache
        return None
