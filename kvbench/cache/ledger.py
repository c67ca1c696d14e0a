"""The byte ledger of an offloading cache: what crosses the host<->device link, and what the device holds.

Every host->device gather of an offloaded layer goes through `TransferLedger.transfer`, which does the copy and counts
its bytes under a category (critical-key channel slices, top-k keys, top-k values), per decode step. The prefill's
device->host offload is counted once. On a CPU-only machine host and device are the same memory, so the ledger
gives the bytes the algorithm *would* move, measured from the tensors it actually gathers, not from a formula.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor

H2D = ("critical_keys", "topk_keys", "topk_values")


class TransferLedger:
    """Counts bytes per category for the prefill offload and for each decode step (a step starts at layer 0)."""

    def __init__(self):
        self.offload: dict[str, int] = defaultdict(int)  # device -> host at prefill
        self.steps: list[dict[str, int]] = []  # host -> device, one dict per decode step
        self.transient_peak: list[int] = []  # per step: most fetched bytes alive at once on the device
        self.resident: list[int] = []  # per step: KV bytes resident on the device when the step begins
        self.held = 0  # fetched bytes alive now: this layer's rows and channel slices, the next layer's slices

    def begin_step(self, resident_bytes: int) -> None:
        self.steps.append(dict.fromkeys(H2D, 0))
        self.transient_peak.append(0)
        self.resident.append(resident_bytes)

    def offloaded(self, category: str, tensor: Tensor) -> None:
        self.offload[category] += tensor.numel() * tensor.element_size()

    def transfer(self, source: Tensor, index: Tensor, device: torch.device, category: str) -> Tensor:
        """Gather rows `index` `[B, H, k]` of the host tensor `source` `[B, H, rows, cols]` (per batch and head) and
        move them to `device`, counting the bytes moved. On CUDA the gather lands in pinned memory and is copied
        asynchronously on the current stream."""
        b, h, k = index.shape
        rows = source.gather(2, index.to(source.device)[..., None].expand(b, h, k, source.shape[-1]))
        if device.type == "cuda":
            rows = rows.pin_memory().to(device, non_blocking=True)
        elif rows.device != device:
            rows = rows.to(device)
        if self.steps:
            self.steps[-1][category] += rows.numel() * rows.element_size()
        return rows

    def hold(self, tensor: Tensor) -> None:
        """A fetched tensor now occupies device memory (until `release`)."""
        self.held += tensor.numel() * tensor.element_size()
        if self.transient_peak:
            self.transient_peak[-1] = max(self.transient_peak[-1], self.held)

    def release(self, *tensors: Tensor) -> None:
        self.held -= sum(t.numel() * t.element_size() for t in tensors)

    def summary(self) -> dict:
        """What a prediction record stores: per-step host->device bytes by category, their mean per token, and the
        prefill offload."""
        per_step = {c: [s[c] for s in self.steps] for c in H2D}
        totals = [sum(s.values()) for s in self.steps]
        return {
            "d2h_prefill_bytes": sum(self.offload.values()),
            "h2d_bytes_per_step": per_step,
            "h2d_bytes_per_token": sum(totals) / len(totals) if totals else 0.0,
            "device_bytes_per_step": self.resident,
            "transient_device_bytes_max": max(self.transient_peak, default=0),  # critical slices of two layers
            #                                                                    (prefetch runs one layer ahead) + rows
        }
