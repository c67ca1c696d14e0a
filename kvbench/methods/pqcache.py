"""PQCache (Zhang et al. 2024, "PQCache: Product Quantization-based KVCache for Long Context LLM Inference"):
retrieval by product-quantized keys from an offloaded cache, without eviction.

Reference: HugoZHL/PQCache@0b74e12 (`vq_method/retrieval_based/pq_search.py`, `multi_core_compressor_v2.py`,
`cache_manager.py`, `run_llama.sh`). The prefill is exact (flash attention over the whole prompt). Afterwards, in
every layer, the keys from the `sink_size` initial tokens on are product-quantized (`partitions` sub-vectors per
head, `2**bits` centroids each, K-means on the prompt's keys), the candidates' K/V go to host memory and each decode
step fetches the top-k candidates by PQ score (`kvbench.cache.pq_offloaded.PQOffloadedLayer`).

Budget semantics (TailorKV's tables: "n_local 64, n_topk 128" at budget 192, "n_local 128, n_topk 896" at 1024):
`budget` = sink_size + recent_size + top-k per KV head per layer; the newest token is attended on top. The split
of n_local into sinks and recent window is not in TailorKV's text: the defaults are the reference script's
`SINK_SIZE=32 RECENT_SIZE=32` (n_local 64); for the RULER/InfiniteBench setting use `method.sink_size=64
method.recent_size=64` (an even split of n_local 128, our choice).

Question-agnostic runs and conversations (`query=agnostic`, `dataset.turns`): a fed question or turn attends every
entry densely (sinks, every host candidate, window, itself causally), as the reference's prefill does (dense flash
attention; its decode step takes one query only); its tokens then join the window, and those older than the last
`recent + 1` become candidates coded by the prompt's centroids (the reference's rule for generated tokens: no
re-clustering), as after the same tokens decoded one by one (`kvbench.cache.pq_offloaded`). The full-candidate
fetch is the ledger's `feed_bytes`. Our decision: the reference has no multi-token append on top of its cache.

Deviations:
- Sizes: the reference derives the window and top-k from ratios of the prompt (`compress_ratio`, `recent_ratio`);
  TailorKV's tables fix them in tokens, as here.
- K-means: the reference runs sklearn on host cores with an iteration count fitted to the GPU's prefill time (at
  least 3; TailorKV: 1 beyond 64k). kvbench runs a seeded Lloyd K-means in torch where the keys are
  (`kvbench.cache.pq`) for a fixed `kmeans_iters` (default 3, the reference's floor; `method.kmeans_iters=1` for
  TailorKV's > 64k runs), deterministic for a given `seed`.
- No GPU block cache (the reference's LFU cache of fetched blocks): every top-k row is fetched every step, so the
  ledger's top-k bytes are an upper bound of the reference's.
- Metric: the reference's default `METRIC=euc` path (inner-product scores from Euclidean K-means); its `ip` variant
  is not implemented.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvbench.cache.kv_cache import KVCache
from kvbench.cache.ledger import StepStart, TransferLedger
from kvbench.cache.pq_offloaded import MOVES, PQOffloadedLayer
from kvbench.methods.base import Kind, Method
from kvbench.registry import METHODS


@METHODS.register("pqcache")
@dataclass
class PQCache(Method):
    sink_size: int = 32  # initial tokens kept on the device, never quantized (reference SINK_SIZE)
    recent_size: int = 32  # local window of recent tokens on the device (reference RECENT_SIZE)
    partitions: int = 2  # PQ sub-vectors per key (SUBVEC)
    bits: int = 6  # code bits per sub-vector: 2**bits centroids (SUBBITS)
    kmeans_iters: int = 3  # Lloyd iterations (the reference's adaptive count is at least 3; TailorKV > 64k: 1)
    seed: int = 0  # K-means initialisation (the same draw in every layer, as the reference)

    kind: ClassVar[Kind] = Kind.STORAGE
    own_storage: ClassVar[bool] = True
    takes_chunks: ClassVar[bool] = True  # a fed question or turn joins the storage and attends it densely

    def __post_init__(self):
        for name, low in (("sink_size", 0), ("recent_size", 0), ("partitions", 1), ("kmeans_iters", 0),
                          ("seed", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"pqcache: {name}={value!r} must be an integer >= {low}")
        if self.bits not in range(1, 9):
            raise ValueError(f"pqcache: bits={self.bits!r} must be one of 1..8 (codes are stored in one byte)")

    def check_budget(self, budget: int | None) -> None:
        super().check_budget(budget)
        if budget <= self.sink_size + self.recent_size:
            raise ValueError(f"pqcache: budget={budget} must exceed sink_size + recent_size = "
                             f"{self.sink_size + self.recent_size} (the top-k part is budget minus both)")

    def attach(self, cache: KVCache, capture, budget: int) -> TransferLedger:
        """Quantize and offload every layer whose prompt is longer than sinks + window + one code per centroid;
        open a ledger entry at each decode step. Returns the ledger of bytes moved."""
        ledger = TransferLedger(MOVES)
        layers = cache.layers
        n_topk = budget - self.sink_size - self.recent_size
        for i, layer in enumerate(layers):
            if i in capture.window_layers:  # a sliding-window layer keeps the model's own window semantics
                continue
            n, d = layer.keys.shape[-2], layer.keys.shape[-1]
            if d % self.partitions:
                raise ValueError(f"pqcache: partitions={self.partitions} does not divide the head dim {d}")
            if n > self.sink_size + self.recent_size and n - self.sink_size >= 2 ** self.bits:
                layers[i] = PQOffloadedLayer.from_layer(layer, self.sink_size, self.recent_size, n_topk,
                                                        self.partitions, self.bits, self.kmeans_iters,
                                                        self.seed, ledger)
        capture.input_hook = StepStart(layers, ledger)
        capture.cache = cache
        return ledger
