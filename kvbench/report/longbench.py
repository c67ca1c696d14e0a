"""LongBench tables and figures in the KV papers' layout, from run directories only.

    df = load_runs(["results/longbench"]); write_reports(df, "results/report")   # python -m kvbench.report does this

`longbench_table.{md,tex,csv}`: PyramidKV Table 1 / Ada-KV Table 1. One block per model and dataset config; rows =
method at a KV size (FullKV first, then budgets ascending, methods in the papers' order), columns = the tasks grouped
by LongBench category, then "Avg." = the plain mean of the task columns (blank when a row lacks one of them). Task
scores are eval.py's round(100 * mean, 2), recomputed from the records (kvbench.data.longbench.summarize_longbench).
The best compressed method per budget and column is bold, as in the papers. The Markdown adds LongBench's own
aggregation (category means, per language) below each block; the CSV carries both, full precision of the rounded
task scores. LongBench-E runs also get `longbench_e_table.{md,csv}` (0-4k / 4-8k / 8k+, mean over tasks).
`longbench_budget.png`: Avg. against KV size, one line per method, FullKV as a dashed line (PyramidKV Fig. 3).
"""
from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from kvbench.data.longbench import summarize_longbench
from kvbench.data.longbench_prompts import ALL21, CATEGORIES, E_BUCKETS, TASKS, base_task
from kvbench.metrics.stats import combine_se
from kvbench.report.compare import MARK, Compare, reference_key, select, significant
from kvbench.report.escape import md_cell, md_row, md_text, tex_escape
from kvbench.report.labels import method_label
from kvbench.report.tables import sort_runs

logger = logging.getLogger(__name__)

KEYS = ["model", "dataset", "method", "budget", "ratio"]
TASK, LENGTH, INDEX = "meta.task", "meta.length", "meta.index"


# --- per-run aggregation ----------------------------------------------------------------------------------------
def run_rows(df: pd.DataFrame) -> list[dict]:
    """One dict per (model, dataset, method, budget, ratio): the keys and `summarize_longbench` of its records.
    Full-cache runs are one row per model and dataset whatever their budget; an id seen twice keeps its last record."""
    df = df[df[TASK].notna()].copy()
    df["budget"] = df["budget"].astype("object").where(df["method"] != "full", None)
    rows = []
    for keys, g in df.groupby(KEYS, dropna=False, sort=False):
        dup = g["id"].duplicated(keep="last")
        if dup.any():
            logger.warning("longbench report: %d duplicate ids for %s; keeping the last of each", dup.sum(), keys)
            g = g[~dup]
        records = [{"score": float(r["score"]), "meta": {"task": r[TASK], "length": _int(r.get(LENGTH)),
                                                          "index": _int(r.get(INDEX))}}
                   for _, r in g.iterrows()]
        rows.append({**dict(zip(KEYS, keys)), **summarize_longbench(records)})
    return rows


def _int(v) -> int:
    return 0 if v is None or (isinstance(v, float) and math.isnan(v)) else int(v)


def task_columns(stems) -> list[str]:
    """Tasks grouped by category in the papers' order; within a category, LongBench's order."""
    stems = set(stems)
    return sorted(stems, key=lambda t: (CATEGORIES.index(TASKS[base_task(t)].category), ALL21.index(base_task(t))))


def kv_size(row: dict) -> str:
    if row["method"] == "full":
        return "Full"
    if row.get("ratio") is not None and not pd.isna(row["ratio"]):
        return f"r{float(row['ratio']):g}"
    return "–" if row.get("budget") is None or pd.isna(row["budget"]) else str(int(row["budget"]))


def table_frame(rows: list[dict]) -> pd.DataFrame:
    """The wide table: KEYS, one column per task stem (x 100 scores), Avg., then LongBench's category means, then
    each score's standard error (`se:<task>`, `se:Avg.`, x 100; kvbench.metrics.stats)."""
    stems = task_columns({t for r in rows for t in r["tasks"] if base_task(t) == t})
    out = []
    for r in rows:
        cells = {t: r["tasks"].get(t) for t in stems}
        have = [v for v in cells.values() if v is not None]
        avg = round(sum(have) / len(have), 2) if have and len(have) == len(stems) else None
        cats = {f"{lang}:{c}": v for lang, block in r["categories"].items() for c, v in block.items()}
        ses = {f"se:{t}": r.get("tasks_se", {}).get(t) for t in stems}
        ses["se:Avg."] = (_combined_se([ses[f"se:{t}"] for t in stems]) if avg is not None else None)
        out.append({**{k: r[k] for k in KEYS}, **cells, "Avg.": avg, **cats, **ses})
    frame = pd.DataFrame(out)
    frame = sort_runs(frame) if len(frame) else frame
    frame.attrs["tasks"] = stems
    return frame.reset_index(drop=True)


def _combined_se(ses: list) -> float | None:
    """se of the plain mean of task scores from the tasks' se's (sqrt(sum se^2) / T,
    kvbench.metrics.stats.combine_se)."""
    ses = [None if s is None or pd.isna(s) else float(s) for s in ses]
    return combine_se(ses, [1 / len(ses)] * len(ses)) if ses else None


def add_differences(frame: pd.DataFrame, df: pd.DataFrame, compare: Compare) -> pd.DataFrame:
    """Each row's paired-bootstrap difference to the reference method (same model and dataset, same KV size if the
    reference ran at it) per task and for Avg.: columns `diff:<col>`, `lo:<col>`, `hi:<col>`; attrs["marks"] holds
    the intervals that exclude 0, attrs["notes"] the legend."""
    records = df[df[TASK].notna()].copy()
    records["budget"] = records["budget"].astype("object").where(records["method"] != "full", None)
    cols = [*frame.attrs["tasks"], "Avg."]
    candidates = [r.to_dict() for _, r in frame[frame["method"] == compare.reference].iterrows()]
    extra, marks = [], {}
    for i, row in frame.iterrows():
        ref = reference_key(row.to_dict(), candidates, ["budget", "ratio"])
        cis = {}
        if ref is not None and row["method"] != compare.reference:
            cis = compare.cells(select(records, row, KEYS), select(records, ref, KEYS),
                                f"{method_label(row['method'])} {kv_size(row)}", 100.0, TASK, frame.attrs["tasks"])
        extra.append({f"{k}:{c}": getattr(cis.get(c), a, None) for c in cols
                      for k, a in (("diff", "diff"), ("lo", "lo"), ("hi", "hi"))})
        marks |= {(i, c): ci for c, ci in cis.items() if significant(ci)}
    out = pd.concat([frame, pd.DataFrame(extra, index=frame.index)], axis=1)
    out.attrs.update(frame.attrs, marks=marks, notes=compare.note())
    return out


# --- rendering ----------------------------------------------------------------------------------------------------
def _fmt(v) -> str:
    return "–" if v is None or pd.isna(v) else f"{float(v):.2f}"


def _cell(frame: pd.DataFrame, i, c: str, stderr: bool) -> str:
    """A score, "± se" with `stderr`, and the mark when its difference to the compared method is significant."""
    text = _fmt(frame.at[i, c])
    se = frame.at[i, f"se:{c}"] if f"se:{c}" in frame else None
    if stderr and text != "–" and se is not None and not pd.isna(se):
        text += f" ± {float(se):.2f}"
    return text


def _best(frame: pd.DataFrame, cols: list[str]) -> set[tuple[int, str]]:
    """(row, column) cells holding the best compressed score of their KV size: ties are all bold, but nothing is
    bold where fewer than two rows have a value or all values are equal."""
    best = set()
    compressed = frame[frame["method"] != "full"]
    for _, g in compressed.groupby(compressed.apply(kv_size, axis=1), sort=False):
        for c in cols:
            values = pd.to_numeric(g[c], errors="coerce").dropna()
            if len(values) >= 2 and values.nunique() > 1:
                best |= {(i, c) for i in values.index[values == values.max()]}
    return best


def _cells(frame: pd.DataFrame, bold: str, esc, stderr: bool = False) -> tuple[list[str], list[list[str]]]:
    """Headers and cells, each escaped by `esc` (kvbench.report.escape) before `bold` wraps the best scores."""
    cols = [*frame.attrs["tasks"], "Avg."]
    best = _best(frame, cols)
    marks = frame.attrs.get("marks", {})
    headers = list(map(esc, ["KV Size", "Method", *[TASKS[t].label for t in frame.attrs["tasks"]], "Avg."]))
    body = []
    for i, row in frame.iterrows():
        cells = [esc(kv_size(row)), esc(method_label(row["method"]))]
        for c in cols:
            text = esc(_cell(frame, i, c, stderr))
            cells.append((bold.format(text) if (i, c) in best else text) + (esc(MARK) if (i, c) in marks else ""))
        body.append(cells)
    return headers, body


def _groups(stems: list[str]) -> list[tuple[str, int]]:
    """(category, number of columns) in column order."""
    out: list[tuple[str, int]] = []
    for t in stems:
        cat = TASKS[base_task(t)].category
        if out and out[-1][0] == cat:
            out[-1] = (cat, out[-1][1] + 1)
        else:
            out.append((cat, 1))
    return out


def to_markdown(frame: pd.DataFrame, stderr: bool = False) -> str:
    """`stderr` shows "mean ± se"; a compared frame (`add_differences`) marks its cells and ends with the legend."""
    headers, body = _cells(frame, "**{}**", md_cell, stderr)
    labels = {c: [TASKS[base_task(t)].label for t in frame.attrs["tasks"] if TASKS[base_task(t)].category == c]
              for c, _ in _groups(frame.attrs["tasks"])}
    groups = " · ".join(f"{c}: {', '.join(names)}" for c, names in labels.items())
    lines = [f"Columns by category: {groups}.", "",
             "| " + " | ".join(headers) + " |", "|:---|:---|" + "---:|" * (len(headers) - 2)]
    lines += ["| " + " | ".join(r) + " |" for r in body]  # cells escaped by _cells
    notes = [md_text(n) for n in frame.attrs.get("notes", [])]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def category_markdown(frame: pd.DataFrame) -> str:
    """LongBench's leaderboard aggregation: category means and their mean, per language."""
    out = []
    for lang in ("en", "zh"):
        cols = [f"{lang}:{c}" for c in (*CATEGORIES, "Avg") if f"{lang}:{c}" in frame]
        if not cols:
            continue
        out += [f"LongBench aggregation ({'English' if lang == 'en' else 'Chinese'}; code counts for both): "
                "category = mean of its tasks, Avg = mean of the categories.", "",
                md_row(["KV Size", "Method", *(c.split(":", 1)[1] for c in cols)]), "|:---|:---|" + "---:|" * len(cols)]
        out += [md_row([kv_size(r), method_label(r["method"]), *[_fmt(r[c]) for c in cols]])
                for _, r in frame.iterrows()]
        out.append("")
    return "\n".join(out)


def to_latex(frame: pd.DataFrame, caption: str = "", stderr: bool = False) -> str:
    """booktabs, a category row spanning its columns above the task labels (needs \\usepackage{booktabs});
    `stderr` and a compared frame's marks and legend as in `to_markdown`."""
    headers, body = _cells(frame, r"\textbf{{{}}}", tex_escape, stderr)
    groups = _groups(frame.attrs["tasks"])
    spans, rules, col = [], [], 3
    for cat, n in groups:
        spans.append(rf"\multicolumn{{{n}}}{{c}}{{{tex_escape(cat)}}}")
        rules.append(rf"\cmidrule(lr){{{col}-{col + n - 1}}}")
        col += n
    lines = [r"\begin{tabular}{ll" + "r" * (len(headers) - 2) + "}", r"\toprule",
             " & ".join(["", "", *spans, ""]) + r" \\", " ".join(rules),
             " & ".join(headers) + r" \\", r"\midrule"]
    previous = None
    for cells in body:
        if previous is not None and cells[0] != previous:
            lines.append(r"\midrule")
        previous = cells[0]
        lines.append(" & ".join(cells) + r" \\")  # escaped by _cells
    lines.append(r"\bottomrule")
    lines += [rf"\multicolumn{{{len(headers)}}}{{l}}{{\footnotesize {tex_escape(n)}}} \\"
              for n in frame.attrs.get("notes", [])]
    lines.append(r"\end{tabular}")
    if caption:
        lines.insert(0, f"% {tex_escape(caption)}")
    return "\n".join(lines) + "\n"


def e_frame(rows: list[dict]) -> pd.DataFrame:
    """LongBench-E: per row the buckets' mean over tasks, plus each task's buckets (CSV)."""
    out = []
    for r in rows:
        if "e_avg" not in r:
            continue
        per_task = {f"{t}:{b}": v for t, buckets in r["e_buckets"].items() for b, v in buckets.items()}
        out.append({**{k: r[k] for k in KEYS}, **r["e_avg"], **per_task})
    frame = pd.DataFrame(out)
    return sort_runs(frame).reset_index(drop=True) if len(frame) else frame


# --- figure -------------------------------------------------------------------------------------------------------
def budget_figure(frame: pd.DataFrame, title: str) -> Figure | None:
    """Avg. against KV size (log2 axis), one line per method; FullKV as a horizontal dashed line."""
    sized = frame[(frame["method"] != "full") & frame["budget"].notna() & frame["Avg."].notna()]
    if sized.empty:
        return None
    fig = Figure(figsize=(6, 4), dpi=150)
    ax = fig.add_subplot()
    for method, g in sized.groupby("method", sort=False):
        g = g.sort_values("budget")
        ax.plot(g["budget"].astype(float), g["Avg."].astype(float), marker="o", label=method_label(method))
    for _, full in frame[(frame["method"] == "full") & frame["Avg."].notna()].iterrows():
        ax.axhline(float(full["Avg."]), color="black", linestyle="--", linewidth=1, label="FullKV")
    budgets = sorted({int(b) for b in sized["budget"]})
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.minorticks_off()
    ax.set_xlabel("KV size (entries per head per layer)")
    ax.set_ylabel("LongBench Avg.")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# --- entry point --------------------------------------------------------------------------------------------------
def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", str(text)).strip("_")


def write_reports(df: pd.DataFrame, out: str | Path, stderr: bool = False,
                  compare: Compare | None = None) -> list[Path]:
    """Write the LongBench tables and the score-vs-budget figure for every (model, dataset) in `df`; `stderr` and
    `compare` (a kvbench.report.compare.Compare) add "± se" and the paired-bootstrap marks to the tables."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if TASK not in df or df[TASK].notna().sum() == 0:
        return []
    rows = run_rows(df)
    md, tex, csv, written = [], [], [], []
    blocks = sorted({(r["model"], r["dataset"]) for r in rows})
    n_main = len({(r["model"], r["dataset"]) for r in rows if any(base_task(t) == t for t in r["tasks"])})
    n_e = len({(r["model"], r["dataset"]) for r in rows if "e_avg" in r})
    for model, dataset in blocks:
        block = [r for r in rows if (r["model"], r["dataset"]) == (model, dataset)]
        frame = table_frame(block)
        title = f"{dataset} · {model}"
        if frame.attrs["tasks"]:
            if compare is not None:
                compare.unpaired.clear()    # each block's legend lists its own unpaired samples
                frame = add_differences(frame, df[(df["model"] == model) & (df["dataset"] == dataset)], compare)
            md += [f"## {md_text(title)}", "", to_markdown(frame, stderr), category_markdown(frame)]
            tex.append(to_latex(frame, caption=title, stderr=stderr))
            csv.append(frame)
            fig = budget_figure(frame, title)
            if fig is not None:
                stem = "longbench_budget" if n_main == 1 else f"longbench_budget_{_slug(model)}_{_slug(dataset)}"
                fig.savefig(out / f"{stem}.png")
                written.append(out / f"{stem}.png")
        e = e_frame(block)
        if len(e):
            stem = "longbench_e_table" if n_e == 1 else f"longbench_e_table_{_slug(model)}_{_slug(dataset)}"
            cols = list(E_BUCKETS)
            md_e = [f"## {md_text(title)} · LongBench-E (mean over tasks per length bucket)", "",
                    md_row(["KV Size", "Method", *cols]), "|:---|:---|" + "---:|" * len(cols)]
            md_e += [md_row([kv_size(r), method_label(r["method"]), *[_fmt(r[c]) for c in cols]])
                     for _, r in e.iterrows()]
            (out / f"{stem}.md").write_text("\n".join(md_e) + "\n", encoding="utf-8")
            e.to_csv(out / f"{stem}.csv", index=False)
            written += [out / f"{stem}.md", out / f"{stem}.csv"]
    if csv:
        (out / "longbench_table.md").write_text("\n".join(md), encoding="utf-8")
        (out / "longbench_table.tex").write_text("\n".join(tex), encoding="utf-8")
        pd.concat(csv, ignore_index=True).to_csv(out / "longbench_table.csv", index=False)
        written = [out / f"longbench_table.{ext}" for ext in ("md", "tex", "csv")] + written
    return written
