"""Compress each layer inside the prefill forward, as soon as its attention has run (`compress_after=layer`).

A prefill-time selection needs one layer's keys and that layer's window queries (or, for the accumulated-attention
methods, its column sums), and both exist once the layer's attention has run. Compressing there, instead of after
the last layer, bounds the KV held during prefill by the compressed layers so far plus one layer's full K/V, where
the whole prompt cache was held before (16 GB at 128k on an 8B model). The choice is made by the same function,
`generation.compress_layer`, on the same tensors, so the kept entries are those of `compress_after=prefill`.

Storage methods (`attach`: TailorKV, whose layer roles need the whole cache) and `full` keep the old order.
A forward hook on each attention module of this model instance (removed on exit) runs after the module returns,
when its local references to the full K/V are gone, so the gather really frees them.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from kvbench.cache import KVCache
from kvbench.methods.base import Kind, Method
from kvbench.methods.contract import layer_budgets


def applies(method: Method) -> bool:
    """Whether `method` can compress one layer at a time (eviction methods, not storage methods, `full`, or KVzip,
    which scores the whole full cache by a second prefill before it selects across layers)."""
    return method.compresses and method.kind not in (Kind.STORAGE, Kind.RECONSTRUCTOR)


@dataclass
class LayerwiseStats:
    full_nbytes: int = 0  # what the uncompressed prompt cache would have held (each layer before its eviction)
    compress_s: float = 0.0  # time spent in the per-layer evictions


@contextmanager
def compress_each_layer(capture, method: Method, cache: KVCache, budget: int | None, prompt_len: int, state=None,
                        active: bool = True, *, compress_layer: Callable[..., None]) -> Iterator[LayerwiseStats]:
    """While active, every prefill attention module's output triggers its layer's eviction in `cache`, by
    `compress_layer` (`generation.compress_layer`, the function the old order calls after the forward)."""
    stats = LayerwiseStats()
    if not active:
        yield stats
        return
    modules = capture.attention_modules
    n_layers = len(modules)
    budgets = layer_budgets(method, prompt_len, n_layers, budget)

    def after_attention(module, args, output) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        sync = torch.cuda.synchronize if hidden.is_cuda else (lambda: None)
        sync()  # CUDA: the layer's queued kernels are prefill time, not the eviction's (it would wait for them)
        t0 = time.perf_counter()
        idx = capture.slots[module.layer_idx]
        stats.full_nbytes += cache.layers[idx].nbytes()
        compress_layer(method, cache, capture, idx, n_layers, budgets[idx], state)
        capture.window_queries.pop(idx, None)  # used: the later layers' peaks need not hold them
        capture.window_bias.pop(idx, None)
        sync()
        stats.compress_s += time.perf_counter() - t0

    handles = [m.register_forward_hook(after_attention) for m in modules.values()]
    try:
        yield stats
    finally:
        for handle in handles:
            handle.remove()
