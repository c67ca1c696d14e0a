"""The memory axis of a run: bits per stored K/V code and bytes per kept entry, so that a 2-bit full cache and a
16-bit budget-128 cache sit on one axis (reports' `bits` and `bytes_per_entry` columns).

`bits` comes from the run's config.yaml: a KIVI store's `method.bits` (`method=kivi`; TailorKV with every layer
quantized, `method.rest=quantized`), a selector's `+method.quantize=kivi<b>`, otherwise the model's dtype (32 for
float32, 16 for float16 / bfloat16); None where layers differ (TailorKV's quantized + offloaded layers) or the dtype
is `auto`. `bytes_per_entry` is a record's `kv_bytes` over the entries it kept (`kept_per_head`, summed over layers
and heads): the bytes one kept token costs in one KV head of one layer, keys and values, scales and residual included.
"""
from __future__ import annotations

import re
from pathlib import Path

import yaml

DTYPE_BITS = {"float32": 32, "float16": 16, "bfloat16": 16, "half": 16, "float": 32}


def kv_bits(config: dict) -> int | None:
    """Bits per stored K/V code of a run's resolved config (module docstring)."""
    method, model = config.get("method") or {}, config.get("model") or {}
    scheme = re.fullmatch(r"kivi(\d)", str(method.get("quantize") or ""))
    if scheme:
        return int(scheme.group(1))
    target = str(method.get("_target_", ""))
    if target.endswith(".KIVI"):
        return int(method["bits"])
    if target.endswith(".TailorKV"):
        return int(method["bits"]) if method.get("rest") == "quantized" else None
    return DTYPE_BITS.get(str(model.get("dtype")))


def run_bits(run_dir: Path) -> int | None:
    """`kv_bits` of a run directory's config.yaml; None without one (a run written by hand or by lm-eval import)."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return None
    return kv_bits(yaml.safe_load(path.read_text(encoding="utf-8")) or {})


def kept_entries(kept_per_head) -> int | None:
    """Entries a record kept, over layers and heads (`kept_per_head`: one list per layer); None if not recorded."""
    if not isinstance(kept_per_head, list) or not kept_per_head:
        return None
    return int(sum(sum(layer) for layer in kept_per_head))
