"""An offloaded cache layer with dynamic top-k retrieval (TailorKV's sparsity-friendly layers).

After prefill the layer's whole prompt K/V moves to host memory (pinned on CUDA), together with a transposed key copy
`Kᵀ [B, H, D, n]` so that one channel across all prompt tokens is one contiguous row. The device keeps only the
sinks and the recent window of the prompt, `max_t |K|` per channel, and every generated token. Each decode step:

1. `prefetch(q̂)`: pick the `n_channels` critical channels per KV head by |group-mean q̂| · max|K| and fetch those
   rows of Kᵀ (the predicted query q̂ comes from the previous layer's input, so this can run one layer ahead);
2. `decode_kv(q)`: approximate scores = (group-mean q)[channels] · Kᵀ[channels] (signed, unscaled), the top-k prompt
   positions in [start, n - recent) are fetched (K and V rows), and exact attention runs over
   sinks + recent + fetched + generated entries (`kvbench.attention.decode`). The fetched rows are freed after the step.

Every host->device copy goes through the `TransferLedger`, so the bytes per token are counted, not estimated.

Several tokens appended at once (`generation.feed`: query=agnostic's question, a conversation's later turns) join
the generated tokens on the device (`update`): never candidates, always attended, as the official code keeps every
generated token; the top-k candidates stay the prompt's. The chunk itself attends the whole layer densely (every
offloaded prompt row, copied from the host, + the generated and fed tokens, causally among its own): the official
code's multi-token path is its prefill, exact attention over every token (it has no retrieval for several queries).
That copy, the layer's whole K and V, goes to the ledger's `feed_bytes`, not to a decode step.

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
        OffloadedLayer.prefetch_many([self], query)

    def decode_kv(self, query: Tensor | None = None) -> DecodeKV:
        """What one token `[B, H_q, 1, D]` attends: sinks + recent + its top-k prompt rows, fetched now + generated
        (the new token was appended by `update` before this call). A chunk of several tokens `[B, H_q, q, D]` (a fed
        question or turn, appended last) attends every entry instead (`_everything`)."""
        if query is not None and query.shape[2] > 1:
            return self._everything()
        return OffloadedLayer.decode_kv_many([self], query)[0]

    def _everything(self) -> DecodeKV:
        """Every prompt row, copied from the host, + the generated and fed tokens, in position order: what a chunk
        fed on top attends (dense, as the official prefill). The copy goes to the ledger's `feed_bytes`."""
        keys, values = self.host_keys.to(self.device), self.host_values.to(self.device)
        self.ledger.fed("offloaded_keys", keys.numel() * keys.element_size())
        self.ledger.fed("offloaded_values", values.numel() * values.element_size())
        b, h = keys.shape[:2]
        prompt = torch.arange(self.prompt_len, device=self.device).expand(b, h, self.prompt_len)
        return DecodeKV(torch.cat([keys, self.keys], dim=2), torch.cat([values, self.values], dim=2), None,
                        torch.cat([prompt, self.positions], dim=2))

    # --- several sequences' layers at once (batched decoding: one call per step and layer, not per sequence) --
    @staticmethod
    def prefetch_many(layers: list[OffloadedLayer], query: Tensor) -> None:
        """`prefetch` for several sequences' layers, row i of `query` `[S, H_q, 1, D]` for `layers[i]`: the channel
        scores and their top-k in one call; each layer then fetches from its own host copy."""
        device = layers[0].device
        if device.type != "cuda":
            OffloadedLayer._fetch_channels(layers, query)
            return
        main, side = torch.cuda.current_stream(device), _side_stream(device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            OffloadedLayer._fetch_channels(layers, query)
            ready = torch.cuda.Event()
            ready.record(side)
        for layer in layers:
            layer.ready = ready
            layer.critical_keys.record_stream(main)

    @staticmethod
    def _fetch_channels(layers: list[OffloadedLayer], query: Tensor) -> None:
        """Critical channels per KV head by |group-mean q̂| · max|K| (one top-k for all); each layer's Kᵀ rows."""
        if len({layer.n_channels for layer in layers}) > 1:  # (configurations that differ: one call each)
            for i, layer in enumerate(layers):
                OffloadedLayer._fetch_channels([layer], query[i:i + 1])
            return
        abs_max = torch.cat([layer.abs_max for layer in layers]) if len(layers) > 1 else layers[0].abs_max
        score = group_mean(query, abs_max.shape[1]).abs() * abs_max.float()
        channels = score.topk(layers[0].n_channels, dim=-1).indices  # [S, H, d_s]
        for i, layer in enumerate(layers):
            layer.channels = channels if len(layers) == 1 else channels[i:i + 1]
            layer.critical_keys = layer.ledger.transfer(layer.host_keys_t, layer.channels, layer.device,
                                                        "critical_keys")
            layer.ledger.hold(layer.critical_keys)

    @staticmethod
    def decode_kv_many(layers: list[OffloadedLayer], query: Tensor | None) -> list[DecodeKV]:
        """`decode_kv` for several sequences' layers, row i of `query` `[S, H_q, 1, D]` for `layers[i]`: the real
        query's group means and the top-k over the approximate scores (each row padded with -inf past its own
        candidates) in one call; each layer then fetches its rows from its own host copy."""
        unready = [i for i, layer in enumerate(layers) if layer.critical_keys is None]
        if unready:  # nothing predicted these layers' query (e.g. layer 0): use the real one
            rows = query if len(unready) == len(layers) else torch.cat([query[i:i + 1] for i in unready])
            OffloadedLayer.prefetch_many([layers[i] for i in unready], rows)
        if len({(layer.start, layer.recent, layer.n_topk) for layer in layers}) > 1:  # (one call per configuration)
            return [OffloadedLayer.decode_kv_many([layer], query[i:i + 1])[0] for i, layer in enumerate(layers)]
        for event in dict.fromkeys(layer.ready for layer in layers if layer.ready is not None):
            torch.cuda.current_stream().wait_event(event)
        start, recent, n_topk = layers[0].start, layers[0].recent, layers[0].n_topk
        channels = torch.cat([layer.channels for layer in layers]) if len(layers) > 1 else layers[0].channels
        picked = group_mean(query, channels.shape[1]).gather(-1, channels)[:, :, None]  # [S, H, 1, d_s]
        rows = []  # each layer's approximate scores over its candidates [start, n - recent): [H, 1, c]
        for i, layer in enumerate(layers):  # (bmm: one layer's `@`, in fewer dispatched ops)
            rows.append(torch.bmm(picked[i], layer.critical_keys[0, :, :, start:layer.prompt_len - recent].float()))
        if len(rows) == 1:
            approx = rows[0].view(1, picked.shape[1], -1)
        else:  # padded with -inf past each row's own candidates, so the top-k never reaches them
            approx = picked.new_full((len(rows), picked.shape[1], max(r.shape[-1] for r in rows)), float("-inf"))
            for i, row in enumerate(rows):
                approx[i, :, :row.shape[-1]] = row[:, 0]
        tops = approx.topk(n_topk, dim=-1).indices + start  # [S, H, k]: each row's top-k among its own candidates
        return [layer._attended(tops if len(layers) == 1 else tops[i:i + 1]) for i, layer in enumerate(layers)]

    def _attended(self, top: Tensor) -> DecodeKV:
        """Fetch the chosen prompt rows `top` `[1, H, k]` and put together what this step attends."""
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
