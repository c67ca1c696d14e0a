"""An offloaded cache layer with dynamic top-k retrieval (TailorKV's sparsity-friendly layers).

After prefill the layer's whole prompt K/V moves to host memory (pinned on CUDA), together with a transposed key copy
`Kᵀ [B, H, D, n]` so that one channel across all prompt tokens is one contiguous row. The device keeps only the
sinks and the recent window of the prompt, `max_t |K|` per channel, and every generated token. Each decode step:

1. `prefetch(q̂)`: pick the `n_channels` critical channels per KV head by |group-mean q̂| · max|K| and fetch those
   rows of Kᵀ (the predicted query q̂ comes from the previous layer's input, so this can run one layer ahead);
2. `decode_kv(q)`: approximate scores = (group-mean q)[channels] · Kᵀ[channels] (signed, unscaled), the top-k prompt
   positions in [start, n - recent) are fetched (K and V rows), and exact attention runs over
   sinks + recent + fetched + generated entries (`kvbench.engine.attention`). The fetched rows are freed after the step.

Every host->device copy goes through the `TransferLedger`, so the bytes per token are counted, not estimated.

CPU (the reference) runs both stages synchronously. On CUDA the host pool is pinned and `prefetch` runs on a side
stream that `decode_kv` waits for; the rows are gathered on the host and copied asynchronously (the official code
gathers with a UVA kernel from DGL, which kvbench does not depend on). Reading the chosen indices back to the host
makes the host wait for the GPU at each sparse layer, so this path overlaps the copies, not the host's work: its
latency is an upper bound on what a UVA-gather implementation would reach.
"""
from __future__ import annotations

import torch
from torch import Tensor

from kvbench.cache.kv_cache import DecodeKV, KVLayer
from kvbench.cache.ledger import TransferLedger


class OffloadedLayer(KVLayer):
    """Host-resident prompt K/V + device-resident sinks/recent/generated; see the module docstring."""

    own_storage = True

    @classmethod
    def from_layer(cls, layer: KVLayer, start: int, recent: int, n_topk: int, n_channels: int,
                   ledger: TransferLedger) -> "OffloadedLayer":
        """Offload a filled prompt layer. Requires `start + recent < n`; `n_topk` is capped at the candidates."""
        keys, values = layer.keys, layer.values
        b, h, n, d = keys.shape
        if start + recent >= n:
            raise ValueError(f"offload: start + recent = {start + recent} must be below the prompt length {n}")
        new = cls()
        new.device, new.dtype, new.is_initialized = keys.device, keys.dtype, True
        new.host_keys, new.host_values = _to_host(keys), _to_host(values)
        new.host_keys_t = _to_host(keys.transpose(-1, -2))
        for name, t in (("keys", new.host_keys), ("values", new.host_values), ("keys_transposed", new.host_keys_t)):
            ledger.offloaded(name, t)
        if keys.is_cuda:  # the host copies were asynchronous: finish them before the CPU gathers read them
            torch.cuda.current_stream().synchronize()
        new.static_keys = torch.cat([keys[:, :, :start], keys[:, :, n - recent:]], dim=2)
        new.static_values = torch.cat([values[:, :, :start], values[:, :, n - recent:]], dim=2)
        new.static_positions = torch.cat([layer.positions[:, :, :start], layer.positions[:, :, n - recent:]], dim=2)
        new.abs_max = keys.abs().amax(dim=2)  # [B, H, D], prompt keys only (never updated while decoding)
        new.keys, new.values = keys.new_empty(b, h, 0, d), values.new_empty(b, h, 0, d)  # generated tokens
        new.positions = layer.positions.new_empty(b, h, 0)
        new.seen_tokens, new.prompt_len = layer.seen_tokens, n
        new.start, new.recent = start, recent
        new.n_topk = min(n_topk, n - start - recent)
        new.n_channels = min(n_channels, d)
        new.ledger = ledger
        new.channels = new.critical_keys = new.ready = None
        new.selections = None  # set to a list to record each step's (channels, top-k) for tests
        return new

    # --- the two stages ---------------------------------------------------------------------------------------
    def prefetch(self, query: Tensor) -> None:
        """Choose critical channels from a (predicted) query `[B, H_q, 1, D]` and fetch their Kᵀ rows. On CUDA the
        fetch runs on a side stream; `decode_kv` waits for it."""
        if self.device.type == "cuda":
            main, side = torch.cuda.current_stream(), _side_stream(self.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                self._fetch_channels(query)
                self.ready = torch.cuda.Event()
                self.ready.record(side)
            self.critical_keys.record_stream(main)
        else:
            self._fetch_channels(query)

    def _fetch_channels(self, query: Tensor) -> None:
        score = group_mean(query, self.abs_max.shape[1]).abs() * self.abs_max.float()
        self.channels = score.topk(self.n_channels, dim=-1).indices  # [B, H, d_s]
        self.critical_keys = self.ledger.transfer(self.host_keys_t, self.channels, self.device, "critical_keys")
        self.ledger.hold(self.critical_keys)

    def decode_kv(self, query: Tensor | None = None) -> DecodeKV:
        """What one token `[B, H_q, 1, D]` attends: sinks + recent + its top-k prompt rows, fetched now + generated
        (the new token was appended by `update` before this call)."""
        if self.critical_keys is None:  # nothing predicted this layer's query (e.g. layer 0): use the real one
            self.prefetch(query)
        if self.ready is not None:
            torch.cuda.current_stream().wait_event(self.ready)
        q_mean = group_mean(query, self.abs_max.shape[1])  # [B, H, D], the real query's signed group mean
        approx = (q_mean.gather(-1, self.channels)[:, :, None] @ self.critical_keys.float())[:, :, 0]  # [B, H, n]
        top = approx[..., self.start: self.prompt_len - self.recent].topk(self.n_topk, dim=-1).indices + self.start
        if self.selections is not None:
            self.selections.append((self.channels.cpu(), top.sort(dim=-1).values.cpu()))
        fetched_k = self.ledger.transfer(self.host_keys, top, self.device, "topk_keys")
        fetched_v = self.ledger.transfer(self.host_values, top, self.device, "topk_values")
        self.ledger.hold(fetched_k)
        self.ledger.hold(fetched_v)
        self.ledger.release(self.critical_keys, fetched_k, fetched_v)  # freed once this layer has attended
        keys = torch.cat([self.static_keys, fetched_k, self.keys], dim=2)
        values = torch.cat([self.static_values, fetched_v, self.values], dim=2)
        positions = torch.cat([self.static_positions, top, self.positions], dim=2)  # (a prefill: index = position)
        self.channels = self.critical_keys = self.ready = None  # the fetched working set is freed after the step
        return DecodeKV(keys, values, None, positions)

    # --- accounting -------------------------------------------------------------------------------------------
    def keep(self, idx: Tensor) -> None:
        raise NotImplementedError("cache: an offloaded layer keeps every token; eviction does not apply")

    def get_seq_length(self) -> int:
        return self.prompt_len + self.keys.shape[-2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[-2] + query_length, 0  # decode attention ignores masks (one token sees all it attends)

    def nbytes(self) -> int:
        """Bytes resident on the compute device between steps: sinks + recent, max|K|, generated tokens."""
        return sum(t.numel() * t.element_size() for t in (self.static_keys, self.static_values, self.abs_max,
                                                         self.keys, self.values))

    def host_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.host_keys, self.host_values, self.host_keys_t))

    def entries_per_head(self) -> list[int]:
        """Entries each head attends per step: sinks + recent + top-k + generated."""
        attended = self.static_keys.shape[2] + self.n_topk + self.keys.shape[2]
        return [attended] * self.static_keys.shape[1]


def group_mean(query: Tensor, n_kv_heads: int) -> Tensor:
    """`[B, H_q, 1, D]` -> `[B, H_kv, D]`: signed mean over each KV group's query heads, fp32 (TailorKV's GQA
    reduction; the channel score takes its absolute value)."""
    b, h_q, _, d = query.shape
    return query.float().reshape(b, n_kv_heads, h_q // n_kv_heads, d).mean(dim=2)


def _to_host(t: Tensor) -> Tensor:
    if t.device.type == "cuda":
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t, non_blocking=True)
    return t.contiguous()


_streams: dict = {}


def _side_stream(device: torch.device):
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device)
    return _streams[device]
