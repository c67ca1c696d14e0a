"""GEAR (Kang et al., arXiv 2403.05527, "GEAR: An Efficient KV Cache Compression Recipe for Near-Lossless Generative
Inference of LLM"): every layer's prompt K/V stored as a KIVI-style quantized backbone + sparse outliers + a low-rank
approximation of the rest, nothing evicted. Reference code: opengear-project/GEAR @ efe0bfe (the simulated
`compress_insert_function`, method "GEAR": `gearslkivi_channelQ_new` for keys, `gearslkivi_tokenQ_new` for values);
kvbench stores the parts for real (`kvbench.cache.gear`, codes packed by the shared `kvbench.cache.quantizer`).

Defaults: the reference's run scripts (`run_template_llama-3-8b.sh`: `--compress_method GEAR --quantize_bit 2
--group_size 64 --loop 3 --prefillrank 4 --prefillrankv 4 --left 0.02`). Quirks kept: the outlier count per row is
the reference's int(int(numel x left) / B / T / 2); value rows and value groups span all heads of a token (the
reference's `[B, T, H x D]` layout, so `group_size` must divide H x D: checked when the model loads); the quantized
backbone is rounded to fp16 before the low-rank part is added; the power iteration starts from uniform random
matrices, drawn here from a generator seeded `seed` + layer index (the reference draws from torch's global one).
Differences: the reference re-compresses every `streaming_gap` (64) generated tokens with ranks 2; kvbench compresses
the prompt once and keeps generated and fed tokens in full precision (they are few next to a long prompt). Decode
attention reads the layer back to fp32. `budget` is not used (every token is kept), as for `full` and `kivi`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbench.cache.gear import GEAR_BITS, GearLayer
from kvbench.cache.kv_cache import KVCache
from kvbench.methods.base import Kind, Method, RefusedForModel
from kvbench.registry import METHODS


@METHODS.register("gear")
@dataclass
class GEAR(Method):
    bits: int = 2  # backbone bits (2 or 4)
    group_size: int = 64  # tokens per key group (per channel); channels per value group (per token, across heads)
    sparsity: float = 0.02  # the reference's `left`: share of entries kept as outliers (half largest, half smallest)
    rank: int = 4  # rank of the low-rank part per head (the reference's prefill ranks); 0: GEAR-S alone
    loop: int = 3  # power-iteration rounds
    seed: int = 0  # the power iteration's random start (+ layer index)

    kind: ClassVar[Kind] = Kind.STORAGE
    own_storage: ClassVar[bool] = True
    takes_chunks: ClassVar[bool] = True  # a fed question joins each layer's full-precision part

    def __post_init__(self):
        if self.bits not in GEAR_BITS:
            raise ValueError(f"gear: bits={self.bits!r} is not one of {', '.join(map(str, GEAR_BITS))} (the "
                             "reference's levels, bits ** 2 - 1, are 2 ** bits - 1 only for these)")
        if not isinstance(self.group_size, int) or self.group_size < 1 or self.group_size % (8 // self.bits):
            raise ValueError(f"gear: group_size={self.group_size!r} must be a positive multiple of {8 // self.bits} "
                             f"({self.bits}-bit codes packed into bytes)")
        if not 0 <= self.sparsity < 1:
            raise ValueError(f"gear: sparsity={self.sparsity} must be in [0, 1)")
        for name in ("rank", "loop", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"gear: {name}={getattr(self, name)} must be >= 0")
        if self.rank and self.loop < 1:
            raise ValueError("gear: loop must be >= 1 when rank > 0 (power-iteration rounds)")

    @property
    def kv_bits(self) -> int:
        return self.bits

    def check_budget(self, budget: int | None) -> None:
        if budget is not None:  # ignored (nothing is evicted), but a nonsensical value is still a mistake
            super().check_budget(budget)

    def prepare(self, model, tokenizer, *, prefill=None) -> dict | None:
        """Refuse, before any sample, a `group_size` that does not divide a token's H x D values."""
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if (heads * head_dim) % self.group_size:
            raise RefusedForModel(f"gear: group_size={self.group_size} must divide a token's values across heads "
                             f"({heads} KV heads x {head_dim} = {heads * head_dim}); pick a divisor of it")
        return None

    def attach(self, cache: KVCache, capture, budget: int | None) -> None:
        """Replace every prefilled layer by its GEAR store (sliding-window layers keep the model's window)."""
        layers = cache.layers
        for i, layer in enumerate(layers):
            if i not in capture.window_layers:
                generator = torch.Generator(device=layer.keys.device).manual_seed(self.seed + i)
                layers[i] = GearLayer.from_layer(layer, self.bits, self.group_size, self.sparsity, self.rank,
                                                 self.loop, generator)
        capture.cache = cache
        return None
