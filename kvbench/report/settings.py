"""Which runs are the same run, so that no report row averages two runs whose settings or samples differ.

A table row is a (model, dataset, method, budget, ratio, query) key, and several run directories can share one: a
NIAH sweep at `dataset.context_lengths=[1000]` beside the demo's grid, the same configuration copied into two
results trees, lm-eval runs at two shot counts. Runs are the same run only where their resolved configs
(config.yaml) agree on every key that names the run directory: everything but NOT_IDENTITY (`limit`, `shard`, how
and where a run executed and wrote) and PLACEMENT.

`setting_labels` gives each run of such a shared key a label saying what differs (`dataset.context_lengths=[1000]`,
the differing keys only), or, where the configs agree but the folders differ (copies, two trees), the folder's path
below their common folder. Runs alone under their key get no label, so a report without such a clash keeps its
layout. Tables key their rows by the label (the `setting` column); paper cells refuse a mix (kvbench.report.paper).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping

import yaml

SETTING = "setting"  # the DataFrame column (load_runs) and the tables' key
ROW_KEYS = ("model", "dataset", "method", "budget", "ratio", "query")  # manifest values that make a table row
# config.yaml's keys that do not name a run directory (configs/config.yaml's run-dir pattern hashes the others):
# how a run executes, which part of its samples, where it writes; and per node, where the model sits
NOT_IDENTITY = ("compress_after", "limit", "shard", "batch_size", "step", "retry_failed", "report", "results_dir",
                "paper_settings", "hydra")
PLACEMENT = ("gpus", "mem_gb", "device_map", "concurrency", "timeout_s", "api_key_env")  # runs.config.PLACEMENT_KEYS


def flatten(node, prefix: str = "") -> dict[str, object]:
    """{"dataset": {"depth_percents": [0, 50]}} -> {"dataset.depth_percents": [0, 50]}."""
    if not isinstance(node, Mapping):
        return {prefix: node}
    out: dict[str, object] = {}
    for key, value in node.items():
        out.update(flatten(value, f"{prefix}{key}.") if isinstance(value, Mapping) and value else
                   {f"{prefix}{key}": value})
    return out


def identity(run_dir: str | Path) -> dict[str, object]:
    """The run's identifying config keys, flattened (empty for a folder without a readable config.yaml)."""
    path = Path(run_dir) / "config.yaml"
    try:
        cfg = yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        cfg = None
    if not isinstance(cfg, Mapping):
        return {}
    flat = flatten({k: v for k, v in cfg.items() if k not in NOT_IDENTITY})
    return {k: v for k, v in flat.items() if not (k.count(".") == 1 and k.split(".")[1] in PLACEMENT)}


def _text(value) -> str:
    return json.dumps(value, separators=(",", ":"), default=str) if not isinstance(value, str) else value


def differing(configs: list[dict[str, object]]) -> list[str]:
    """The keys whose values are not the same in every config (a key one config lacks differs)."""
    keys = sorted({k for c in configs for k in c})
    return [k for k in keys if len({_text(c[k]) if k in c else "\0unset" for c in configs}) > 1]


def label(config: dict[str, object], keys: list[str]) -> str:
    return ", ".join(f"{k}={_text(config[k]) if k in config else 'unset'}" for k in keys)


def setting_labels(rows: Mapping[str, tuple]) -> dict[str, str | None]:
    """run_dir -> its label (None where it is alone under its row key). `rows`: run_dir -> its ROW_KEYS values."""
    by_key: dict[tuple, list[str]] = {}
    for run_dir, key in rows.items():
        by_key.setdefault(tuple(_text(v) for v in key), []).append(run_dir)
    out: dict[str, str | None] = {d: None for d in rows}
    for dirs in by_key.values():
        if len(dirs) < 2:
            continue
        configs = [identity(d) for d in dirs]
        keys = differing(configs)
        labels = [label(c, keys) for c in configs] if keys else [""] * len(dirs)
        if len(set(labels)) < len(dirs):  # the same settings in different folders: the folders tell them apart
            common = os.path.commonpath([os.path.abspath(d) for d in dirs])
            labels = [", ".join(x for x in (text, f"run={os.path.relpath(d, common)}") if x)
                      for text, d in zip(labels, dirs)]
        out.update(zip(dirs, labels))
    return out


def setting_parts(df) -> list[tuple[str | None, object]]:
    """The records (load_runs' DataFrame) in parts none of which holds two runs of one row key, for the layouts
    that key rows by method and budget only (the benchmark tables, lengths.md): (None, the runs without a label),
    then per label (label, those runs plus that label's). Without labels: [(None, df)]."""
    if SETTING not in df or df[SETTING].isna().all():
        return [(None, df)]
    plain = df[SETTING].isna()
    return [(None, df[plain])] + [(text, df[plain | (df[SETTING] == text)])
                                  for text in sorted(df.loc[~plain, SETTING].unique())]


def folder_name(text: str) -> str:
    """`setting-<readable part>-<hash>`: a label as a folder name, short and unique."""
    import hashlib
    import re

    readable = re.sub(r"[^A-Za-z0-9._=-]+", "_", text).strip("_")[:60]
    return f"setting-{readable}-{hashlib.sha256(text.encode()).hexdigest()[:6]}"
