"""What compression does to a generation's length, memory and time: one row per (model, dataset, method, budget).

Compression can make a model write longer answers (a reasoning trace that loses its place goes round again), and a
longer answer costs decode steps that a smaller cache saved ("Rethinking Key-Value Cache Compression", MLSys 2025;
"Hold Onto That Thought", arXiv 2512.12008): so accuracy is shown beside the mean length, its inflation over the
same samples' full-cache lengths (`length_ratio` = new_tokens / the full-cache run's new_tokens for that sample id,
joined by `add_length_ratio` when a full-cache run of the same model, dataset and query mode exists), the KV held
while decoding (`kv_bytes_peak`, `kv_bytes_mean`), the end-to-end time per sample (`e2e_s`) and how many answers
hit `max_new_tokens`. Every mean carries its standard error (sd / sqrt(n); where a problem ran several times, the
mean of the problems' means and sd of those / sqrt(problems), as pass@1: kvbench.report.compare.sample_units).
Written for the long-generation datasets (`LONG_GENERATION`) and, with `--lengths`, for any run.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from kvbench.report.escape import md_row, slug
from kvbench.report.labels import method_label
from kvbench.metrics.stats import unit_mean_se
from kvbench.report.compare import sample_units
from kvbench.report.tables import score_scale, size_keys, sort_runs

LONG_GENERATION = ("gsm8k", "math500", "aime24", "aime25")  # datasets whose reports always get this table
KEYS = ["model", "dataset", "query", "method"]  # and the size columns (tables.size_keys: budget, ratio)
OPTIONAL = ("e2e_s", "kv_bytes_peak", "kv_bytes_mean", "stop_reason")  # fields records gained later
MIB = 2 ** 20


def add_length_ratio(df: pd.DataFrame) -> pd.DataFrame:
    """`length_ratio` per record: its new_tokens over the full-cache run's for the same (model, dataset, query, id);
    NaN where there is no such record or it generated nothing."""
    full = df[df["method"] == "full"].drop_duplicates(["model", "dataset", "query", "id"])
    reference = full.set_index(["model", "dataset", "query", "id"])["new_tokens"].astype(float)
    keys = pd.MultiIndex.from_frame(df[["model", "dataset", "query", "id"]])
    base = reference.reindex(keys).to_numpy()
    out = df.copy()  # (positional arrays: the frame's own index may have gaps, e.g. after a filter)
    out["length_ratio"] = df["new_tokens"].astype(float).to_numpy() / np.where(base > 0, base, np.nan)
    return out


def length_table(df: pd.DataFrame) -> pd.DataFrame:
    """The table's rows (means and standard errors as numbers; `to_markdown` formats them). Records from before a
    field existed count as missing for it, not as zero."""
    df = df[df["new_tokens"].notna()].reindex(columns=[*df.columns, *(c for c in OPTIONAL if c not in df)])
    df = add_length_ratio(df)
    rows = []
    keys = [*KEYS, *size_keys(df)]
    for key, g in df.groupby(keys, dropna=False, sort=False):
        row, units = dict(zip(keys, key), n=len(g)), sample_units(g)
        for name, values in (("score", g["score"] * score_scale(g["score"])), ("length", g["new_tokens"]),
                             ("inflation", g["length_ratio"]), ("e2e_s", g["e2e_s"]),
                             ("kv_peak_mib", g["kv_bytes_peak"] / MIB), ("kv_mean_mib", g["kv_bytes_mean"] / MIB)):
            estimate = unit_mean_se(values.astype(float), units)
            row[name], row[f"{name}_se"] = estimate.mean, estimate.se
        stops = g["stop_reason"].dropna()
        row["truncated"] = float((stops == "max_new_tokens").mean()) if len(stops) else None
        rows.append(row)
    return sort_runs(pd.DataFrame(rows)) if rows else pd.DataFrame(rows)


COLUMNS = [("model", "Model", "{}"), ("dataset", "Dataset", "{}"), ("method", "Method", "{}"),
           ("budget", "KV Size", "{}"), ("n", "n", "{:d}"), ("score", "Acc.", "{:.2f}"),
           ("length", "Mean length", "{:.1f}"), ("inflation", "Length / full", "{:.3f}"),
           ("truncated", "Hit max_new_tokens", "{:.0%}"), ("kv_peak_mib", "Peak KV MiB", "{:.2f}"),
           ("kv_mean_mib", "Mean KV MiB", "{:.2f}"), ("e2e_s", "End-to-end s", "{:.2f}")]


def _cell(row, column: str, fmt: str) -> str:
    value = row.get(column)
    if column == "budget" and pd.notna(row.get("ratio")):  # a ratio run: each sample's budget from its length
        return f"r{float(row['ratio']):g}"
    if value is None or (isinstance(value, float) and pd.isna(value)):
        return "–"
    if column == "method":
        return method_label(value) + ("" if row.get("query", "aware") == "aware" else f" ({row['query']})")
    if column == "budget" and isinstance(value, float):
        value = int(value)
    text = fmt.format(value)
    se = row.get(f"{column}_se")
    return text + (f" ± {fmt.format(se)}" if se is not None and not pd.isna(se) else "")


def to_markdown(table: pd.DataFrame) -> str:
    lines = [md_row([header for _, header, _ in COLUMNS]), md_row([":---"] * len(COLUMNS))]
    lines += [md_row([_cell(row, c, fmt) for c, _, fmt in COLUMNS]) for row in table.to_dict("records")]
    return "\n".join(lines)


def length_figure(table: pd.DataFrame, title: str):
    """Accuracy and mean length against the budget, a line per method; the full cache as a dashed line."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.4))
    axes = fig.subplots(1, 2)
    for ax, column, label in zip(axes, ("score", "length"), ("accuracy", "mean new tokens")):
        for method, g in table.groupby("method", sort=False):
            if method == "full":
                ax.axhline(float(g[column].iloc[0]), color="black", linestyle="--", linewidth=1, label="FullKV")
                continue
            g = g.dropna(subset=["budget"]).sort_values("budget")
            ax.errorbar(g["budget"].astype(float), g[column].astype(float), yerr=g[f"{column}_se"].astype(float),
                        marker="o", capsize=2, label=method_label(method))
        ax.set_xscale("log", base=2)
        budgets = sorted(table["budget"].dropna().astype(int).unique())
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.minorticks_off()
        ax.set_xlabel("KV size (entries per head)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def write_reports(df: pd.DataFrame, out: str | Path) -> list[Path]:
    """lengths.md (the table for every model and dataset) and one lengths_<model>_<dataset>.png each."""
    table = length_table(df)
    if table.empty:
        return []
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "lengths.md"]
    text = "# Length, memory and time under compression\n\n" + to_markdown(table) + "\n"
    written[0].write_text(text, encoding="utf-8")
    for (model, dataset), part in table.groupby(["model", "dataset"], sort=True):
        if part["budget"].notna().sum() == 0:
            continue
        path = out / f"lengths_{slug(model)}_{slug(dataset)}.png"
        length_figure(part, f"{model} on {dataset}".replace("$", r"\$")).savefig(path, dpi=120)
        written.append(path)
    return written
