"""Reports' memory axis (kvbench.report.bits): bits per stored code from each run's config.yaml, bytes per kept entry
from its records, in the summary table; a 2-bit full cache and a 32-bit budget-64 cache side by side."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvbench.report import load_runs, summary_table
from kvbench.report.bits import kv_bits
from tests.unit.test_report import make_run, record

FP32 = {"model": {"dtype": "float32"}}


@pytest.mark.parametrize("config, bits", [
    ({**FP32, "method": {"_target_": "kvbench.methods.snapkv.SnapKV"}}, 32),
    ({"model": {"dtype": "bfloat16"}, "method": {"_target_": "kvbench.methods.snapkv.SnapKV"}}, 16),
    ({**FP32, "method": {"_target_": "kvbench.methods.kivi.KIVI", "bits": 2}}, 2),
    ({**FP32, "method": {"_target_": "kvbench.methods.snapkv.SnapKV", "quantize": "kivi4"}}, 4),
    ({**FP32, "method": {"_target_": "kvbench.methods.tailorkv.TailorKV", "bits": 1, "rest": "quantized"}}, 1),
    ({**FP32, "method": {"_target_": "kvbench.methods.tailorkv.TailorKV", "bits": 1, "rest": "offload"}}, None),
    ({"model": {"dtype": "auto"}, "method": {"_target_": "kvbench.methods.full.Full"}}, None),
])
def test_bits_from_the_resolved_config(config, bits):
    assert kv_bits(config) == bits


def test_summary_table_puts_quantized_and_evicting_runs_on_one_axis(tmp_path: Path):
    root = tmp_path / "results"
    # KIVI-2: every one of 2 layers x 2 heads x 300 entries kept, 9000 bytes per sample -> 7.5 bytes per entry
    kivi = make_run(root, "kivi-2", 128, [record(i, 1.0, kept_per_head=[[300, 300], [300, 300]], kv_bytes=9000)
                                         for i in range(2)])
    # SnapKV 64 at fp32: 2 x 2 x 64 entries, 2 (K, V) x 16 channels x 4 bytes each = 128 bytes per entry
    snap = make_run(root, "snapkv", 64, [record(i, 0.5, kept_per_head=[[64, 64], [64, 64]], kv_bytes=256 * 128)
                                         for i in range(3)])
    (kivi / "config.yaml").write_text(yaml.safe_dump({**FP32, "method": {"_target_": "kvbench.methods.kivi.KIVI",
                                                                         "bits": 2}}))
    (snap / "config.yaml").write_text(yaml.safe_dump({**FP32, "method": {"_target_": "kvbench.methods.snapkv.SnapKV"}}))
    t = summary_table(load_runs([root])).set_index("method")
    assert t.loc["kivi-2", "bits"] == 2 and t.loc["kivi-2", "bytes_per_entry"] == pytest.approx(7.5)
    assert t.loc["snapkv", "bits"] == 32 and t.loc["snapkv", "bytes_per_entry"] == pytest.approx(128.0)
