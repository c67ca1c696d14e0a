"""What each configuration of a report cost: GPU-hours (and wall-hours, hosts, shards) from the run manifests.

A sharded run's manifest.json (written by `kvbench.merge`) sums its shards' sessions; an unsharded run's sums its
own resumes. GPU-hours are wall time x GPUs held, so a CPU run shows 0 GPU-hours and its wall-hours.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from kvbench.report.escape import md_cell
from kvbench.report.runs import MANIFEST, read_manifest


def cost_lines(run_dirs: Iterable[str | Path]) -> list[str]:
    """One `GPU-hours` line per run directory (one configuration), sorted; runs without cost records are skipped.
    The manifest's names are escaped as Markdown cells (kvbench.report.escape): the lines go into cost.md."""
    lines = []
    for run_dir in sorted({Path(d) for d in run_dirs}):
        manifest = read_manifest(run_dir) if (run_dir / MANIFEST).is_file() else {}
        cost = manifest.get("cost")
        if not cost:
            continue
        size = f"r{manifest['ratio']}" if manifest.get("ratio") is not None else f"b{manifest.get('budget')}"
        config = " | ".join(md_cell(manifest.get(k)) for k in ("dataset", "model", "method")) + f" | {md_cell(size)}"
        shards = f", {len(manifest['shards'])} shards" if manifest.get("shards") else ""
        lines.append(f"GPU-hours {cost['gpu_s'] / 3600:.2f} | wall-hours {cost['wall_s'] / 3600:.2f} | {config} "
                     f"({manifest.get('n_samples')} samples{shards} on {md_cell(', '.join(cost.get('hosts', [])))})")
    return lines
