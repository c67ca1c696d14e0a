"""Components built for tests (instantiated through `_target_` on the command line): a NIAH dataset whose scorer
raises on one sample and a SnapKV whose scoring runs out of CUDA memory once, each once per flag file (removed as
it raises, so a rerun of the same command succeeds); an H2O that fails one sample's decode step; and a NIAH dataset
that holds its run after the first record, so a test can signal a run that cannot have finished."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import ClassVar
from pathlib import Path

import torch

from kvbench.data.niah import NeedleHaystack
from kvbench.methods.h2o import H2O
from kvbench.methods.snapkv import SnapKV


def consume(flag: str) -> bool:
    path = Path(flag)
    if flag and path.exists():
        path.unlink()
        return True
    return False


@dataclass
class FaultyNeedle(NeedleHaystack):
    fail_id: str = ""     # the sample whose scoring raises
    fail_flag: str = ""   # ... while this file exists

    def score(self, sample, prediction):
        if sample.id == self.fail_id and consume(self.fail_flag):
            raise ValueError("a scorer edge case\nwith a second line that must not reach the record")
        return super().score(sample, prediction)


@dataclass
class HeldNeedle(NeedleHaystack):
    """Scores its first sample, then holds the run in the next sample's scorer until `release` exists: a run still
    going when its first record is on disk, however fast the machine (a signal ends the wait)."""

    release: str = ""
    scored: int = field(default=0, init=False)

    def score(self, sample, prediction):
        while self.scored and not Path(self.release).exists():
            time.sleep(0.05)
        self.scored += 1
        return super().score(sample, prediction)


@dataclass
class OutOfMemorySnapKV(SnapKV):
    oom_flag: str = ""    # the first scoring call while this file exists runs out of memory

    def scores(self, view):
        if consume(self.oom_flag):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (test)")
        return super().scores(view)


@dataclass
class StepFailingH2O(H2O):
    """An H2O whose decode-time eviction raises on the third decode step of the sample with `fail_prompt_len`
    prompt tokens (a failure inside a batched forward)."""

    fail_prompt_len: int = 0

    def evict(self, state, layer_idx, scores, prefill):
        if not prefill and state.prompt_len == self.fail_prompt_len and state.step == 3:
            raise RuntimeError("a decode step failed (test)")
        return super().evict(state, layer_idx, scores, prefill)


@dataclass
class BrokenSnapKV(SnapKV):
    """A method with a bug that fails every sample (an index out of range in its scoring)."""

    def scores(self, view):
        raise IndexError("index 99 is out of bounds for dimension 2 with size 64")


@dataclass
class OffByOneSnapKV(SnapKV):
    """A selector with an off-by-one bug: "the last n_keep entries" one past the end, so every sample fails at its
    first layer. Not registered (the registry's names each have a YAML); it names itself in errors."""

    registry_name: ClassVar[str] = "snapkv_off_by_one"

    def select(self, view, n_keep):
        n = view.prompt_len
        return torch.arange(n - n_keep + 1, n + 1, device=view.keys.device).expand(*view.keys.shape[:2], n_keep)
