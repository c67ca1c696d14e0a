"""The compressed KV cache: per layer, per KV head, with real memory accounting."""
from kvbench.cache.kv_cache import KVCache, KVLayer

__all__ = ["KVCache", "KVLayer"]
