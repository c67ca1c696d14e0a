"""The byte ledger of a storage method's cache: what crosses the host<->device link, what a step reads, what the
device holds.

Every host->device gather of an offloaded layer goes through `TransferLedger.transfer`, which does the copy and counts
its bytes under a category (TailorKV: critical-key channel slices, top-k keys, top-k values), per decode step. The
prefill's device->host offload is counted once. On a CPU-only machine host and device are the same memory, so the
ledger gives the bytes the algorithm *would* move, measured from the tensors it actually gathers, not from a formula.

Each category has a direction (`h2d` host->device, `d2h` device->host while decoding, `read` bytes a step reads from
device memory without moving them: Quest's page metadata and selected pages); the summary reports each direction
present. `count` adds bytes the layer computed itself (a 0-dim tensor is fine: it is resolved in `summary`, so a step
never waits on the device for it). `StepStart` is the capture hook that opens each step's entry at layer 0. What a
chunk fed on top of the cache (`generation.feed`) moves or reads goes to `feed_bytes` (`fed`), not to a step.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor

from kvbench.cache.kv_cache import gather_rows

H2D = ("critical_keys", "topk_keys", "topk_values")


class TransferLedger:
    """Counts bytes per category for the prefill offload and for each decode step (a step starts at layer 0).
    `categories`: name -> direction (`h2d`, `d2h`, `read`); default TailorKV's three host->device categories."""

    def __init__(self, categories: dict[str, str] | None = None):
        self.categories = categories if categories is not None else dict.fromkeys(H2D, "h2d")
        self.offload: dict[str, int] = defaultdict(int)  # device -> host at prefill
        self.steps: list[dict[str, int]] = []  # bytes per category, one dict per decode step
        self.transient_peak: list[int] = []  # per step: most fetched bytes alive at once on the device
        self.resident: list[int] = []  # per step: KV bytes resident on the device when the step begins
        self.held = 0  # fetched bytes alive now: this layer's rows and channel slices, the next layer's slices
        self.feed: dict[str, int] = defaultdict(int)  # bytes fed chunks moved or read (`fed`), by category

    def begin_step(self, resident_bytes: int) -> None:
        self.steps.append(dict.fromkeys(self.categories, 0))
        self.transient_peak.append(0)
        self.resident.append(resident_bytes)

    def offloaded(self, category: str, tensor: Tensor) -> None:
        self.offload[category] += tensor.numel() * tensor.element_size()

    def transfer(self, source: Tensor, index: Tensor, device: torch.device, category: str) -> Tensor:
        """Gather rows `index` `[B, H, k]` of the host tensor `source` `[B, H, rows, cols]` (per batch and head) and
        move them to `device`, counting the bytes moved. On CUDA the gather lands in pinned memory and is copied
        asynchronously on the current stream."""
        rows = gather_rows(source, index.to(source.device))
        if device.type == "cuda":
            rows = rows.pin_memory().to(device, non_blocking=True)
        elif rows.device != device:
            rows = rows.to(device)
        if self.steps:
            self.steps[-1][category] += rows.numel() * rows.element_size()
        return rows

    def copy(self, source: Tensor, device: torch.device, category: str) -> Tensor:
        """Move the whole host tensor `source` to `device` (PQCache's codes and centroids), counting its bytes."""
        moved = source.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else source.to(device)
        self.count(category, source.numel() * source.element_size())
        return moved

    def count(self, category: str, nbytes) -> None:
        """Add `nbytes` (an int, or a 0-dim tensor resolved at `summary`) to this step's `category`."""
        if self.steps:
            self.steps[-1][category] = self.steps[-1][category] + nbytes

    def fed(self, category: str, nbytes) -> None:
        """Add `nbytes` to what chunks fed on top of the cache (`generation.feed`: query=agnostic's question, a
        turn) moved or read: the whole stored context once per feed, kept apart from the decode steps."""
        self.feed[category] = self.feed[category] + nbytes

    def restart(self) -> None:
        """Forget the decode steps and feeds recorded so far (a conversation's next turn reports its own); the
        prefill offload stays."""
        self.steps, self.transient_peak, self.resident = [], [], []
        self.feed = defaultdict(int)

    def hold(self, tensor: Tensor) -> None:
        """A fetched tensor now occupies device memory (until `release`)."""
        self.held += tensor.numel() * tensor.element_size()
        if self.transient_peak:
            self.transient_peak[-1] = max(self.transient_peak[-1], self.held)

    def release(self, *tensors: Tensor) -> None:
        self.held -= sum(t.numel() * t.element_size() for t in tensors)

    def summary(self) -> dict:
        """What a prediction record stores: per-step bytes by category and their mean per token, for each direction
        (`h2d_bytes_per_step`, `h2d_bytes_per_token`, ...), and the prefill offload."""
        out: dict = {"d2h_prefill_bytes": sum(self.offload.values())}
        for direction in dict.fromkeys(self.categories.values()):
            names = [c for c, d in self.categories.items() if d == direction]
            per_step = {c: [int(s[c]) for s in self.steps] for c in names}
            totals = [sum(per_step[c][i] for c in names) for i in range(len(self.steps))]
            out[f"{direction}_bytes_per_step"] = per_step
            out[f"{direction}_bytes_per_token"] = sum(totals) / len(totals) if totals else 0.0
        if self.feed:  # (only where a chunk was fed: the records of other runs keep their keys)
            out["feed_bytes"] = {c: int(n) for c, n in self.feed.items()}
        return {
            **out,
            "device_bytes_per_step": self.resident,
            "transient_device_bytes_max": max(self.transient_peak, default=0),  # critical slices of two layers
            #                                                                    (prefetch runs one layer ahead) + rows
        }


class StepStart:
    """The capture's input hook of a storage method without a prefetch of its own (Quest, PQCache): at layer 0 of
    each decode step, open the ledger's entry for it. A plain object (not a closure), so a prepared sample can be
    deep-copied."""

    def __init__(self, layers: list, ledger: TransferLedger):
        self.layers, self.ledger = layers, ledger

    def __call__(self, layer_idx: int, hidden, position_embeddings) -> None:
        if layer_idx == 0:
            self.ledger.begin_step(sum(layer.nbytes() for layer in self.layers))

    def rebind(self, layers: list, ledger: TransferLedger) -> StepStart:
        """This hook on a copy's layers and ledger (a conversation's `reset` turn decodes on a copy of the cache)."""
        return StepStart(layers, ledger)
