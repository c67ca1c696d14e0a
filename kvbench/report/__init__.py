"""Reports built from run directories only: tables (Markdown, LaTeX, CSV) and NIAH heatmaps.

    df = load_runs(["results/niah"])            # one row per prediction record, manifest columns added
    table = summary_table(df)                   # one row per (model, dataset, method, budget)
    write_tables(table, "results/report")       # table.md, table.tex, table.csv
    needle_panels(df, "results/report/needle_panels.png")

The CLI does the same: `python -m kvbench.report results/ --out results/report`. The runner calls
`write_run_report(run_dir)` when a run finishes.
"""
from __future__ import annotations

import importlib
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

# The names in __all__ load with their module on first use (PEP 562): the run store reads records through
# `kvbench.report.records`, which runs this file, and a run with report=false (or a command refused by its checks)
# must not pay for pandas and matplotlib.
_EXPORTS = {"has_needle_grid": "heatmap", "needle_heatmap": "heatmap", "needle_matrix": "heatmap",
            "needle_panels": "heatmap", "run_caption": "heatmap", "find_run_dirs": "runs", "load_runs": "runs",
            "read_predictions": "runs", "summary_table": "tables", "to_latex": "tables", "to_markdown": "tables",
            "write_tables": "tables", "has_turns": "turns", "turn_heatmap": "turns"}

__all__ = ["find_run_dirs", "has_needle_grid", "load_runs", "needle_heatmap", "needle_matrix", "needle_panels",
           "read_predictions", "run_caption", "summary_table", "to_latex", "to_markdown", "write_run_report",
           "write_tables"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def failures_note(run_dir: Path) -> list[str]:
    """summary.md lines for failed samples (excluded from the table's means; a rerun retries them); the error text
    is escaped (kvbench.report.escape), so a `|` or a line break in it stays inside its cell."""
    from kvbench.report.escape import md_row
    from kvbench.report.runs import read_predictions
    from kvbench.report.records import is_failure, latest_per_id

    failed = [r for r in latest_per_id(read_predictions(run_dir / "predictions.jsonl")) if is_failure(r)]
    if not failed:
        return ["", "n_failed: 0"]
    return ["", f"n_failed: {len(failed)} (excluded from every mean; rerun the same command to retry them)", "",
            "| id | error | where |", "|:---|:---|:---|",
            *(md_row([r["id"], f"{r['error_type']}: {r['error']}", r["where"]]) for r in failed)]


def write_run_report(run_dir: str | Path) -> None:
    """Write summary.md (and heatmap.png for NIAH records) into a finished run's directory.

    Works on a partial run too (it reads whatever predictions.jsonl holds), so it can also be rerun by hand.
    """
    from kvbench.metrics.stats import unit_mean_se
    from kvbench.report.compare import sample_units
    from kvbench.report.escape import md_row, md_text, plain_figure_text
    from kvbench.report.heatmap import has_needle_grid, needle_heatmap
    from kvbench.report.runs import load_runs
    from kvbench.report.tables import summary_table, to_markdown
    from kvbench.report.turns import has_turns, turn_heatmap

    run_dir = Path(run_dir)
    df = load_runs([run_dir])
    lines = [f"# {md_text(run_dir.name)}", "", f"Run directory: `{run_dir}`", ""]
    if df.empty:
        lines.append("No complete prediction records yet.")
    else:
        lines += [to_markdown(summary_table(df), stderr=True),
                  "Every metric (mean over samples, native scale; se = sd / sqrt(n); where a problem ran several "
                  "times, over problems: n problems, each its samples' mean):", "",
                  "| metric | mean | se | n |", "|:---|---:|---:|---:|"]
        metric_cols = sorted(c for c in df.columns if c.startswith("scores."))
        for c in metric_cols:
            est = unit_mean_se(df[c].astype(float), sample_units(df))
            mean, se = ("–" if v is None else f"{v:.4f}" for v in (est.mean, est.se))
            lines.append(md_row([c.removeprefix("scores."), mean, se, est.n]))
        with plain_figure_text():
            if has_needle_grid(df):
                needle_heatmap(df, run_dir / "heatmap.png")
                lines += ["", "![needle heatmap](heatmap.png)"]
            if has_turns(df):  # multi-turn: accuracy by turn and depth
                turn_heatmap(df, run_dir / "turns.png")
                lines += ["", "![accuracy by turn and depth](turns.png)"]
    lines += failures_note(run_dir)
    (run_dir / "summary.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    logger.info("report: wrote %s", run_dir / "summary.md")
