"""scripts/kvpress_golden_common.py's read-back of kept entries, on hand-made tensors: every kvpress golden fixture
rests on it, and the scripts themselves run only in kvpress's venv (never in the suite)."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
try:
    common = importlib.import_module("kvpress_golden_common")
finally:
    sys.path.remove(str(ROOT / "scripts"))


def test_kept_keys_are_matched_to_the_rows_they_copy():
    full = torch.arange(24.0).reshape(2, 6, 2)  # [H, n, D]
    kept = torch.stack([full[0, [1, 4]], full[1, [0, 5]]])  # [H, k, D]
    assert common.matched_positions(kept[0], full[0]) == [1, 4]
    assert common.matched_masks([kept], [full]) == [["0x12", "0x21"]]


def test_a_key_matching_no_row_fails():
    full = torch.arange(12.0).reshape(6, 2)
    with pytest.raises(AssertionError, match="no single uncompressed key"):
        common.matched_positions(full[:2] + 0.5, full, "case")


def test_channels_limit_the_comparison():
    full = torch.arange(12.0).reshape(4, 3)
    kept = full[[2]].clone()
    kept[:, 1] = 0  # a channel ThinK zeroed
    assert common.matched_positions(kept, full, channels=(kept != 0).any(0)) == [2]


def test_unmasked_positions_are_the_complement_and_are_cleared():
    module = SimpleNamespace(masked_key_indices=(torch.tensor([0, 0, 0]), torch.tensor([0, 1, 1]),
                                                 torch.tensor([2, 0, 3])))
    assert common.unmasked_positions(module, 4, 2) == [{0, 1, 3}, {1, 2}]
    assert module.masked_key_indices is None
    assert common.unmasked_masks([module], 4, 2) == [["0xf", "0xf"]]  # nothing masked: every entry
