"""What each configuration of a report cost: GPU-hours (and wall-hours, hosts, shards) from the run manifests.

A sharded run's manifest.json (written by `kvbench.merge`) sums its shards' sessions; an unsharded run's sums its
own resumes. GPU-hours are wall time x GPUs held, so a CPU run shows 0 GPU-hours and its wall-hours.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from kvbench.report.escape import md_cell
from kvbench.report.runs import MANIFEST, read_manifest


def size_text(manifest: dict) -> str:
    """What the run kept, as its folder names it: `all` (the full cache), `r0.5`, `b128`."""
    if manifest.get("method") == "full" or manifest.get("budget") is None and manifest.get("ratio") is None:
        return "all"
    return f"r{manifest['ratio']}" if manifest.get("ratio") is not None else f"b{manifest['budget']}"


def cost_lines(run_dirs: Iterable[str | Path]) -> list[str]:
    """One `GPU-hours` line per run directory (one configuration), sorted; runs without any time record are skipped.
    The manifest's names are escaped as Markdown cells (kvbench.report.escape): the lines go into cost.md.

    A grid-launched run (`hydra/launcher=grid`) records the wall time of its whole group, whose configurations
    shared each prefill: its line says so, and its GPU-hours are 0 on a CPU and unknown (`?`) elsewhere, since the
    grid does not record how many GPUs the model spanned."""
    lines = []
    for run_dir in sorted({Path(d) for d in run_dirs}):
        manifest = read_manifest(run_dir) if (run_dir / MANIFEST).is_file() else {}
        config = " | ".join(md_cell(manifest.get(k)) for k in ("dataset", "model", "method"))
        config += f" | {md_cell(size_text(manifest))}"
        cost = manifest.get("cost")
        if cost:
            shards = f", {len(manifest['shards'])} shards" if manifest.get("shards") else ""
            lines.append(f"GPU-hours {cost['gpu_s'] / 3600:.2f} | wall-hours {cost['wall_s'] / 3600:.2f} | {config} "
                         f"({manifest.get('n_samples')} samples{shards} on "
                         f"{md_cell(', '.join(cost.get('hosts', [])))})")
        elif manifest.get("launcher") == "grid" and isinstance(manifest.get("wall_s"), (int, float)):
            wall_s = float(manifest["wall_s"])
            on_cpu = str((manifest.get("hardware") or {}).get("device", "")) == "cpu"
            gpu = "0.00" if on_cpu else "?"
            shared = manifest.get("grid_configs")
            lines.append(f"GPU-hours {gpu} | wall-hours {wall_s / 3600:.2f} | {config} "
                         f"({manifest.get('n_samples')} samples, grid: its group's time, shared by {shared} "
                         f"configurations)")
    return lines
