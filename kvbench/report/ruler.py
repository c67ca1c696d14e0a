"""RULER reports from run directories: the per-task table with its average, in RULER's layout, and two figures.

    python -m kvbench.report results/ruler --out results/report      # calls write_reports for the `ruler` family

- `ruler_table.{md,tex,csv}`: one row per (model, method, KV size, length), one column per task in RULER's order
  (`scripts/synthetic.yaml`) and "Avg." (the mean over the row's tasks), as in RULER's summary and the KV papers'
  RULER tables (e.g. TailorKV Table 16). Task scores are recomputed from the predictions with upstream's batched
  metric and rounding, so they are RULER's numbers, not means of rounded values. The full cache is one row per
  length whatever `budget` its runs were launched with.
- `ruler_summary.csv`: RULER's `summary.csv` content in long form (task, score, nulls) for every configuration.
- `ruler_vs_budget.png`: average vs KV size per method (full cache dashed), one panel per (model, length).
- `ruler_vs_length.png`: average vs length per method and KV size, one panel per model.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from kvbench.data.ruler.templates import ALL_TASKS, task_metric
from kvbench.metrics.ruler import postprocess, string_match_all, string_match_part, task_score
from kvbench.metrics.stats import combine_se, mean_se
from kvbench.report.compare import MARK, Compare, reference_key, select, significant
from kvbench.report.escape import md_row, md_text, tex_escape
from kvbench.report.labels import METHOD_NAMES, method_label
from kvbench.report.tables import sort_runs

logger = logging.getLogger(__name__)

TASK, LENGTH = "meta.task", "meta.length"
KEYS = ["model", "dataset_version", "method", "budget", "ratio", "length"]
HEADERS = {"model": "Model", "dataset_version": "Version", "method": "Method", "budget": "KV Size", "ratio": "Ratio",
           "length": "Length"}
DPI = 150
SAMPLE_METRIC = {"string_match_all": string_match_all, "string_match_part": string_match_part}


def has_ruler_records(df: pd.DataFrame) -> bool:
    return TASK in df and LENGTH in df and bool(df[TASK].notna().any())


def task_scores(df: pd.DataFrame) -> pd.DataFrame:
    """Long table: one row per configuration and task with RULER's score, nulls and n. The full cache's budget is
    dropped (it keeps everything) and its duplicate records across budgets are counted once."""
    df = _records(df)
    rows = []
    for key, g in df.groupby([*KEYS, TASK], dropna=False, sort=False):
        preds = [postprocess(str(p)) for p in g["prediction"]]
        task = key[-1]
        refs = [list(r) for r in g["references"]]
        per_sample = [SAMPLE_METRIC[task_metric(task)](p, r) for p, r in zip(preds, refs)]
        rows.append({**dict(zip(KEYS, key[:-1])), "task": task,
                     "score": task_score(task_metric(task), preds, refs),
                     "nulls": f"{sum(len(p) == 0 for p in preds)}/{len(preds)}", "n": len(preds),
                     "se": mean_se(per_sample).scaled(100).se})
    out = pd.DataFrame(rows)
    out["budget"] = out["budget"].astype("Int64")
    out["ratio"] = out["ratio"].astype("Float64")
    return out


def _records(df: pd.DataFrame) -> pd.DataFrame:
    """RULER records keyed like the table: integer length, no budget or ratio for the full cache, each id once."""
    df = df[df[TASK].notna()].copy()
    df["length"] = df[LENGTH].astype(int)
    full = df["method"] == "full"
    df["budget"] = df["budget"].astype("Int64").mask(full)
    df["ratio"] = df["ratio"].astype("Float64").mask(full)
    return df.drop_duplicates(subset=[*KEYS, "id"], keep="first")


def with_uncertainty(wide: pd.DataFrame, scores: pd.DataFrame, df: pd.DataFrame,
                     compare: Compare | None = None) -> pd.DataFrame:
    """`wide` plus each score's standard error (`se:<task>`, `se:Avg.`, x 100; the average's from its tasks'
    samples, sqrt(sum se^2) / T) and, with `compare`, the paired-bootstrap difference to the reference method
    (`diff:`, `lo:`, `hi:` columns; attrs["marks"] = intervals excluding 0, attrs["notes"] = the legend)."""
    tasks = [c for c in wide.columns if c in ALL_TASKS]
    keys = [k for k in KEYS if k in wide.columns]
    out = wide.copy()
    for t in tasks:
        per_task = scores[scores["task"] == t]
        out[f"se:{t}"] = [next(iter(select(per_task, r, keys)["se"]), None) for _, r in wide.iterrows()]
    out["se:Avg."] = [_mean_se([r[f"se:{t}"] for t in tasks if pd.notna(r[t])]) for _, r in out.iterrows()]
    if compare is None:
        return out
    records = _records(df)
    candidates = [r.to_dict() for _, r in wide[wide["method"] == compare.reference].iterrows()]
    extra, marks = [], {}
    for i, row in wide.iterrows():
        same_row = [c for c in candidates if all(c[k] == row[k] for k in ("model", "length"))]
        ref = reference_key(row.to_dict(), same_row, ["budget", "ratio"])
        cis = {}
        if ref is not None and row["method"] != compare.reference:
            have = [t for t in tasks if pd.notna(row[t])]
            label = f"{method_label(row['method'])} {'' if pd.isna(row['budget']) else row['budget']} @{row['length']}"
            cis = compare.cells(select(records, row, keys), select(records, ref, keys), label, 100.0, TASK, have)
        extra.append({f"{k}:{c}": getattr(cis.get(c), k, None) for c in [*tasks, "Avg."]
                      for k in ("diff", "lo", "hi")})
        marks |= {(i, c): ci for c, ci in cis.items() if significant(ci)}
    out = pd.concat([out, pd.DataFrame(extra, index=out.index)], axis=1)
    out.attrs.update(marks=marks, notes=compare.note())
    return out


def _mean_se(ses: list) -> float | None:
    ses = [None if s is None or pd.isna(s) else float(s) for s in ses]
    return combine_se(ses, [1 / len(ses)] * len(ses)) if ses else None


def wide_table(scores: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration; task columns in RULER's order, then "Avg." (mean over the row's tasks)."""
    tasks = [t for t in ALL_TASKS if t in set(scores["task"])]
    rows = [{**dict(zip(KEYS, key)), **dict(zip(g["task"], g["score"]))}
            for key, g in scores.groupby(KEYS, dropna=False, sort=False)]
    wide = pd.DataFrame(rows).reindex(columns=[*KEYS, *tasks])
    wide["budget"] = wide["budget"].astype("Int64")
    wide["Avg."] = wide[tasks].mean(axis=1).round(2)
    wide = sort_runs(wide.assign(dataset="ruler")).drop(columns="dataset")
    wide = wide.sort_values(["model", "length"], kind="stable")
    keep = ["model", "method", "budget", *(["ratio"] if wide["ratio"].notna().any() else []), "length"]
    if wide["dataset_version"].nunique() > 1:
        keep.insert(1, "dataset_version")
    return wide[[*keep, *tasks, "Avg."]].reset_index(drop=True)


def cells(wide: pd.DataFrame, missing: str, stderr: bool = False) -> tuple[list[str], list[list[str]], list[bool]]:
    """Headers, cell strings and right-alignment flags: labels as text, KV size and length as integers, scores
    with 2 decimals (RULER's rounding); "± se" with `stderr`, the mark where `with_uncertainty` found the
    difference to the compared method significant. The se/diff columns themselves go to the CSV only."""
    marks = wide.attrs.get("marks", {})
    shown = [c for c in wide.columns if ":" not in c]

    def fmt_score(i, col: str, v) -> str:
        text = fmt(col, v)
        se = wide.at[i, f"se:{col}"] if f"se:{col}" in wide else None
        if stderr and text != missing and se is not None and pd.notna(se):
            text += f" ± {float(se):.2f}"
        return text + (MARK if (i, col) in marks else "")

    def fmt(col: str, v) -> str:
        if v is None or v is pd.NA or (isinstance(v, float) and pd.isna(v)):
            return missing
        if col == "method":
            return method_label(v)
        if col in ("budget", "length"):
            return str(int(v))
        if col == "ratio":
            return f"{float(v):g}"
        return f"{v:.2f}" if col not in HEADERS else str(v)
    headers = [HEADERS.get(c, c) for c in shown]
    rows = [[fmt(c, row[c]) if c in HEADERS else fmt_score(i, c, row[c]) for c in shown] for i, row in wide.iterrows()]
    return headers, rows, [c not in ("model", "dataset_version", "method") for c in shown]


def to_markdown(wide: pd.DataFrame, stderr: bool = False) -> str:
    headers, rows, right = cells(wide, "–", stderr)
    lines = [md_row(headers), "|" + "|".join("---:" if r else ":---" for r in right) + "|"]
    notes = [md_text(n) for n in wide.attrs.get("notes", [])]
    return "\n".join(lines + [md_row(r) for r in rows] + ([""] + notes if notes else [])) + "\n"


def to_latex(wide: pd.DataFrame, stderr: bool = False) -> str:
    """A booktabs tabular (\\usepackage{booktabs}); task names as RULER spells them."""
    headers, rows, right = cells(wide, "--", stderr)
    lines = [r"\begin{tabular}{" + "".join("r" if r else "l" for r in right) + "}", r"\toprule",
             " & ".join(map(tex_escape, headers)) + r" \\", r"\midrule"]
    lines += [" & ".join(map(tex_escape, r)) + r" \\" for r in rows]
    lines.append(r"\bottomrule")
    lines += [rf"\multicolumn{{{len(headers)}}}{{l}}{{\footnotesize {tex_escape(n)}}} \\"
              for n in wide.attrs.get("notes", [])]
    return "\n".join(lines + [r"\end{tabular}"]) + "\n"


def skipped_tasks(df: pd.DataFrame) -> dict[str, str]:
    """Tasks a run skipped and why (scores.json `ruler.skipped`, e.g. qa_1 without SQuAD), over all runs."""
    skipped: dict[str, str] = {}
    for run_dir in df["run_dir"].dropna().unique() if "run_dir" in df else []:
        path = Path(run_dir) / "scores.json"
        if path.is_file():
            skipped.update(json.loads(path.read_text(encoding="utf-8")).get("ruler", {}).get("skipped", {}))
    return skipped


def notes(scores: pd.DataFrame, skipped: dict[str, str] | None = None) -> list[str]:
    missing = [t for t in ALL_TASKS if t not in set(scores["task"])]
    lines = [f"Scores: RULER's metrics (string_match_part for qa, string_match_all otherwise), x100. "
             f"Avg. = mean over the tasks shown; n per task = {sorted(set(scores['n']))}."]
    if missing:
        lines.append(f"Not run: {', '.join(missing)}; the average covers {len(ALL_TASKS) - len(missing)} of 13 tasks.")
    lines += [f"Skipped {task}: {why}." for task, why in (skipped or {}).items() if task in missing]
    return lines


def _panel_grid(n: int, width: float = 4.2, height: float = 3.2) -> tuple[Figure, list]:
    cols = min(n, 3)
    rows = (n + cols - 1) // cols
    fig = Figure(figsize=(width * cols, height * rows), dpi=DPI, layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel().tolist()
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]


def _method_order(methods) -> list[str]:
    order = {m: i for i, m in enumerate(METHOD_NAMES)}
    return sorted(methods, key=lambda m: (order.get(m, len(order)), m))


def plot_vs_budget(wide: pd.DataFrame, path: Path) -> Path | None:
    """Average vs KV size, a line per method, the full cache as a dashed line; a panel per (model, length)."""
    data = wide[wide["budget"].notna() | (wide["method"] == "full")]
    if not data["budget"].notna().any():
        return None
    panels = list(data.groupby(["model", "length"], sort=False))
    fig, axes = _panel_grid(len(panels))
    for ax, ((model, length), g) in zip(axes, panels):
        for method in _method_order(g["method"].unique()):
            m = g[g["method"] == method].sort_values("budget")
            if method == "full":
                ax.axhline(m["Avg."].iloc[0], color="black", linestyle="--", linewidth=1, label="FullKV")
            else:
                ax.plot(m["budget"].astype(int), m["Avg."], marker="o", label=method_label(method))
        budgets = sorted(int(b) for b in g["budget"].dropna().unique())
        _style_axis(ax, budgets, [str(b) for b in budgets], f"{model}, {length} tokens",
                    "KV size (entries per head per layer)")
    fig.savefig(path)
    return path


def _style_axis(ax, ticks: list[int], labels: list[str], title: str, xlabel: str) -> None:
    """The shared look of both RULER figures: log2 x axis with the given ticks, 0-100 y axis, grid, legend."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, labels)
    ax.minorticks_off()
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("RULER Avg.")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot_vs_length(wide: pd.DataFrame, path: Path) -> Path:
    """Average vs length, a line per (method, KV size); a panel per model."""
    data = wide.assign(length_int=wide["length"].astype(int))
    panels = list(data.groupby("model", sort=False))
    fig, axes = _panel_grid(len(panels), width=5.0)
    for ax, (model, g) in zip(axes, panels):
        keys = [k for k in ("method", "budget", "ratio") if k in g]
        for key, m in g.groupby(keys, dropna=False, sort=False):
            row = dict(zip(keys, key))
            method, budget, ratio = row["method"], row.get("budget"), row.get("ratio")
            label = method_label(method)
            if pd.notna(budget):
                label += f" {int(budget)}"
            elif ratio is not None and pd.notna(ratio):
                label += f" r{float(ratio):g}"
            m = m.sort_values("length_int")
            style = dict(color="black", linestyle="--") if method == "full" else {}
            ax.plot(m["length_int"], m["Avg."], marker="o", label=label, **style)
        lengths = sorted(g["length_int"].unique())
        _style_axis(ax, lengths, [f"{x // 1024}K" if x % 1024 == 0 else str(x) for x in lengths], model,
                    "length (tokens)")
    fig.savefig(path)
    return path


def write_reports(df: pd.DataFrame, out: str | Path, stderr: bool = False,
                  compare: Compare | None = None) -> list[Path]:
    """The RULER table (md/tex/csv), the long summary CSV and the two figures into `out`; returns the paths.
    The CSV always has the se columns; `stderr` shows "± se" in md/tex, `compare` adds the paired-bootstrap marks."""
    if not has_ruler_records(df):
        return []
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    scores = task_scores(df)
    wide = wide_table(scores)
    table = with_uncertainty(wide, scores, df, compare)
    note = notes(scores, skipped_tasks(df))
    paths = [out / "ruler_table.md", out / "ruler_table.tex", out / "ruler_table.csv", out / "ruler_summary.csv"]
    paths[0].write_text(to_markdown(table, stderr) + "\n" + "\n".join(map(md_text, note)) + "\n", encoding="utf-8")
    paths[1].write_text(to_latex(table, stderr) + "".join(f"% {tex_escape(n)}\n" for n in note), encoding="utf-8")
    table.to_csv(paths[2], index=False)
    scores.to_csv(paths[3], index=False)
    paths += [p for p in (plot_vs_budget(wide, out / "ruler_vs_budget.png"),
                          plot_vs_length(wide, out / "ruler_vs_length.png")) if p is not None]
    logger.info("report: RULER table and figures in %s", out)
    return paths
