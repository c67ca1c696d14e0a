"""A KV memory pool of fixed bytes and the admission rule: what a request may hold at most, known before its prefill.

A request's reservation is its most KV entries per layer and KV head, times the bytes of one entry across every
layer and KV head (keys and values): the full cache holds its prompt and every token it may still decode; a prefill
selector (SnapKV, PyramidKV, Ada-KV, KVzip) keeps at most `budget` of the prompt per head on average, then decodes on
top; a decode-time evictor (H2O, TOVA, the rolling windows) holds its budget plus the token it is scoring. These are
upper bounds of what the cache reports (`KVCache.nbytes`), whatever the prompt, so a pool that admits by them is never
exceeded (tests/unit/test_serving.py checks it at every step of a real run). Methods whose bytes follow a threshold,
their own storage or compression while decoding have no such bound before the prefill: refused in one line."""
from __future__ import annotations

from dataclasses import dataclass

from kvbench.methods.base import Kind, Method

BOUNDED_KINDS = (Kind.SELECTOR, Kind.RECONSTRUCTOR, Kind.EVICTOR)


@dataclass(frozen=True)
class KVShape:
    """What one cached token costs: keys and values in every layer and KV head."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype_bytes: int

    @property
    def entry_bytes(self) -> int:
        """Bytes of one KV entry per layer and head, summed over layers and heads (keys + values)."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def of(cls, model) -> KVShape:
        config = getattr(model.config, "text_config", None) or model.config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(config.num_hidden_layers, kv_heads, head_dim, next(model.parameters()).element_size())


def check_bounded(method: Method, decode_compression_on: bool = False) -> None:
    """Refuse, before weights load, a method whose KV has no bound known before its prefill."""
    name = method.registry_name
    if method.kind not in BOUNDED_KINDS or method.threshold_budget or decode_compression_on \
            or method.own_decode_compression(1 << 30) is not None:
        raise ValueError(f"serving: {name}'s KV bytes have no bound before its prefill (own storage, a threshold, or "
                         "compression while decoding), so a pool cannot admit it; use a prefill selector (snapkv, "
                         "pyramidkv, adakv, ...), a decode-time evictor (h2o, tova, ...) or full")


def reserved_entries(method: Method, prompt_len: int, budget: int | None, max_new_tokens: int) -> int:
    """The most KV entries per layer and KV head (averaged) a request holds while it runs."""
    if not method.compresses or budget is None:
        return prompt_len + max_new_tokens
    if method.kind is Kind.EVICTOR:
        return min(prompt_len + max_new_tokens, budget + 1)
    return min(prompt_len, budget) + max_new_tokens


class KVPool:
    """Bytes reserved by the running requests, never above `capacity_bytes`."""

    def __init__(self, capacity_bytes: int):
        if capacity_bytes <= 0:
            raise ValueError(f"serving: pool_bytes={capacity_bytes} must be > 0")
        self.capacity_bytes, self.used_bytes, self.peak_bytes = int(capacity_bytes), 0, 0

    def fits(self, nbytes: int) -> bool:
        return self.used_bytes + nbytes <= self.capacity_bytes

    def reserve(self, nbytes: int) -> bool:
        """Take `nbytes` if they fit; False (nothing taken) otherwise."""
        if not self.fits(nbytes):
            return False
        self.used_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        return True

    def release(self, nbytes: int) -> None:
        assert 0 <= nbytes <= self.used_bytes, (nbytes, self.used_bytes)
        self.used_bytes -= nbytes
