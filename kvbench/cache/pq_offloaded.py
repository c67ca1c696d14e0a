"""An offloaded cache layer with top-k retrieval by product-quantized keys (PQCache's layers).

After the (exact) prefill the keys from `sink` on are product-quantized (`kvbench.cache.pq.train`); the K/V of the
retrieval candidates, positions [sink, n - recent), move to host memory (pinned on CUDA), as do the codes and the
centroids. The device keeps the `sink` initial tokens and a local window: the last `recent` tokens before the newest,
plus the newest. Each decode step (`decode_kv`):

1. copies the candidates' codes and the centroids to the device (the reference prefetches both for every layer and
   step, `prefetch_codebook`);
2. approximates each query head's logits over the candidates from the codes, takes a softmax with scale 1/sqrt(D)
   per query head and sums it over the heads of each KV group (the reference's GQA reduction), and fetches the
   top-`n_topk` candidates' K and V rows from the host (among equal weights the earlier candidate: keys of the same
   codes weigh the same, `kvbench.cache.ranking`);
3. attention runs exactly over sinks + fetched rows + window (`kvbench.attention.decode`).

When a token is appended (`update`) and the window already holds `recent + 1` tokens, its oldest token leaves: its
K/V is copied to the host and becomes a candidate, with the code it got from the prompt's K-means (prompt tokens) or
its nearest centroid (generated tokens; the reference's `predict_index_gpu`). So every step attends
sink + n_topk + recent + 1 entries, however long the generation.

Several tokens appended at once (`generation.feed`: query=agnostic's question, a conversation's later turns) join
the window as that many decoded tokens would: the window keeps the last `recent + 1`, and the older ones go to the
host as candidates, coded by their nearest prompt centroids (the reference's rule for generated tokens; no
re-clustering), so the storage after a feed equals that after the same tokens appended one per step. The chunk
itself attends everything densely (sinks, every candidate fetched from the host, window, itself causally): the
reference's prefill is dense flash attention over the whole prompt, and its decode step asserts a single query
("Do not support multi query pq_search yet", `pq_search.py`), so a dense chunk is the faithful extension. Its
fetches and the window tokens it sends to the host go to the ledger's `feed_bytes`, not to a decode step.

Every copy goes through the `TransferLedger`: host->device codes, centroids, top-k keys and values, device->host
window tokens, and the prefill offload. The reference also keeps a GPU-side LFU cache of fetched blocks
(`cache_manager.py`), which spares some top-k copies; kvbench does not, so its top-k bytes are the no-cache upper
bound.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from kvbench.cache import pq
from kvbench.cache.kv_cache import DecodeKV, KVLayer
from kvbench.cache.ledger import TransferLedger
from kvbench.cache.ranking import top_first

MOVES = {"pq_codes": "h2d", "pq_centroids": "h2d", "topk_keys": "h2d", "topk_values": "h2d",
         "window_keys": "d2h", "window_values": "d2h"}


class PQOffloadedLayer(KVLayer):
    """Host candidates + device sinks/window, retrieval by PQ codes; see the module docstring."""

    own_storage = True

    @classmethod
    def from_layer(cls, layer: KVLayer, sink: int, recent: int, n_topk: int, partitions: int, bits: int,
                   iters: int, seed: int, ledger: TransferLedger) -> "PQOffloadedLayer":
        """Quantize and offload a filled prompt layer. Requires `sink + recent < n`, `n - sink >= 2**bits` and
        `partitions` dividing the head dimension; `n_topk` is capped at the candidates."""
        keys, values = layer.keys, layer.values
        b, h, n, d = keys.shape
        if sink + recent >= n or n - sink < 2 ** bits or d % partitions:
            raise ValueError(f"pqcache: a {n}-token layer of head dim {d} cannot hold {sink} sinks + {recent} recent "
                             f"+ {2 ** bits} centroids in {partitions} partitions")
        new = cls()
        new.device, new.dtype, new.is_initialized = keys.device, keys.dtype, True
        centroids, codes = pq.train(keys[:, :, sink:], partitions, bits, iters, seed)
        new.centroids = _to_host(centroids.to(keys.dtype))  # [B, H, M, C, D/M]
        new.codes = _to_host(codes)  # [B, H, M, capacity]: codes of the tokens from `sink` on
        new.n_coded = n - sink  # the prompt's tokens have codes (the window's too, used once they leave it)
        n_cand = n - sink - recent
        new.host_keys, new.host_values = _to_host(keys[:, :, sink:n - recent]), _to_host(values[:, :, sink:n - recent])
        for name, t in (("keys", new.host_keys), ("values", new.host_values), ("codes", new.codes),
                        ("centroids", new.centroids)):
            ledger.offloaded(name, t)
        if keys.is_cuda:  # the host copies were asynchronous: finish them before the CPU gathers read them
            torch.cuda.current_stream().synchronize()
        new.n_cand = n_cand  # host rows in use: candidate i sits at position sink + i
        new.sink_keys, new.sink_values = keys[:, :, :sink].clone(), values[:, :, :sink].clone()
        new.sink_positions = layer.positions[:, :, :sink].clone()
        new.keys, new.values = keys[:, :, n - recent:].clone(), values[:, :, n - recent:].clone()  # the window
        new.positions = layer.positions[:, :, n - recent:].clone()
        new.seen_tokens = layer.seen_tokens
        new.sink, new.recent, new.n_topk, new.ledger = sink, recent, n_topk, ledger
        new.selections = None  # set to a list to record each step's top-k positions `[B, H, k]` for tests
        return new

    # --- the window slides, candidates grow ---------------------------------------------------------------------
    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Append tokens to the window (one per decode step; several when a chunk is fed), then move its oldest
        tokens beyond `recent + 1` to the host: the window ends as it would after that many single steps. Returns
        the window (attention reads `decode_kv`)."""
        super().update(key_states, value_states, *args, **kwargs)
        leaving = self.keys.shape[-2] - self.recent - 1
        if leaving > 0:
            self._offload_oldest(leaving, self.ledger.fed if key_states.shape[-2] > 1 else self.ledger.count)
        return self.keys, self.values

    def _offload_oldest(self, count: int, tally) -> None:
        out_k, out_v = self.keys[:, :, :count], self.values[:, :, :count]
        end = self.n_cand + count
        if self.n_coded < end:  # generated tokens have no code yet: their nearest centroids
            fresh = pq.encode(out_k[:, :, self.n_coded - self.n_cand:], self.centroids.to(self.device))
            self.codes = _grow(self.codes, end)
            self.codes[..., self.n_coded:end] = fresh.cpu()
            self.n_coded = end
        self.host_keys = _grow(self.host_keys, end, dim=2)
        self.host_values = _grow(self.host_values, end, dim=2)
        self.host_keys[:, :, self.n_cand:end] = out_k.cpu()
        self.host_values[:, :, self.n_cand:end] = out_v.cpu()
        tally("window_keys", out_k.numel() * out_k.element_size())
        tally("window_values", out_v.numel() * out_v.element_size())
        self.n_cand = end
        self.keys, self.values = self.keys[:, :, count:], self.values[:, :, count:]
        self.positions = self.positions[:, :, count:]

    # --- retrieval ----------------------------------------------------------------------------------------------
    def decode_kv(self, query: Tensor | None = None) -> DecodeKV:
        """What one token `[B, H_q, 1, D]` attends: sinks + its top-k candidates, fetched now + the window (the new
        token, appended by `update`, last). A chunk of several tokens `[B, H_q, q, D]` (a fed question or turn)
        attends every entry instead (`_everything`)."""
        if query is not None and query.shape[2] > 1:
            return self._everything()
        codes = self.ledger.copy(self.codes[..., :self.n_cand], self.device, "pq_codes")
        centroids = self.ledger.copy(self.centroids, self.device, "pq_centroids")
        logits = pq.approximate_logits(query, centroids, codes)  # [B, H, G, N]
        weight = (logits / math.sqrt(query.shape[-1])).softmax(dim=-1).sum(dim=2)  # [B, H, N]
        top = top_first(weight, min(self.n_topk, self.n_cand))  # (ties: the earlier candidate)
        if self.selections is not None:
            self.selections.append((top.sort(dim=-1).values + self.sink).cpu())
        fetched_k = self.ledger.transfer(self.host_keys, top, self.device, "topk_keys")
        fetched_v = self.ledger.transfer(self.host_values, top, self.device, "topk_values")
        for t in (codes, centroids, fetched_k, fetched_v):
            self.ledger.hold(t)
        self.ledger.release(codes, centroids, fetched_k, fetched_v)  # freed once this layer has attended
        keys = torch.cat([self.sink_keys, fetched_k, self.keys], dim=2)
        values = torch.cat([self.sink_values, fetched_v, self.values], dim=2)
        positions = torch.cat([self.sink_positions, top + self.sink, self.positions], dim=2)
        return DecodeKV(keys, values, None, positions)

    def _everything(self) -> DecodeKV:
        """Sinks + every candidate, fetched from the host + the window (the fed chunk last), in position order: what a
        chunk fed on top attends (dense, as the reference's prefill). The fetch goes to the ledger's `feed_bytes`."""
        keys, values = (t[:, :, :self.n_cand].to(self.device) for t in (self.host_keys, self.host_values))
        self.ledger.fed("candidate_keys", keys.numel() * keys.element_size())
        self.ledger.fed("candidate_values", values.numel() * values.element_size())
        b, h = keys.shape[:2]
        candidates = torch.arange(self.sink, self.sink + self.n_cand, device=self.device).expand(b, h, self.n_cand)
        return DecodeKV(torch.cat([self.sink_keys, keys, self.keys], dim=2),
                        torch.cat([self.sink_values, values, self.values], dim=2), None,
                        torch.cat([self.sink_positions, candidates, self.positions], dim=2))

    # --- accounting ---------------------------------------------------------------------------------------------
    def keep(self, idx: Tensor) -> None:
        raise NotImplementedError("cache: a PQCache layer keeps every token; eviction does not apply")

    def get_seq_length(self) -> int:
        return self.sink + self.n_cand + self.keys.shape[-2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[-2] + query_length, 0  # decode attention ignores masks (one token sees all it attends)

    def nbytes(self) -> int:
        """Bytes resident on the device between steps: sinks and window K/V."""
        return sum(t.numel() * t.element_size() for t in (self.sink_keys, self.sink_values, self.keys, self.values))

    def host_nbytes(self) -> int:
        """Bytes allocated in host memory: candidates' K/V (with room to grow), codes and centroids."""
        return sum(t.numel() * t.element_size() for t in (self.host_keys, self.host_values, self.codes,
                                                         self.centroids))

    def entries_per_head(self) -> list[int]:
        """Entries each head attends per step: sinks + top-k + window."""
        attended = self.sink + min(self.n_topk, self.n_cand) + self.keys.shape[-2]
        return [attended] * self.keys.shape[1]


def _to_host(t: Tensor) -> Tensor:
    if t.device.type == "cuda":
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t, non_blocking=True)
    return t.contiguous().clone()


def _grow(t: Tensor, rows: int, dim: int = -1) -> Tensor:
    """`t` with room for at least `rows` along `dim` (amortized: + max(256, 1/16) of the size; pinned stays
    pinned). The valid content is the caller's to track."""
    size = t.shape[dim]
    if rows <= size:
        return t
    shape = list(t.shape)
    shape[dim] = max(rows, size + max(256, size // 16))
    grown = torch.empty(shape, dtype=t.dtype, pin_memory=t.is_pinned())
    grown.narrow(dim, 0, size).copy_(t)
    return grown
