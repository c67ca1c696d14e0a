"""Summary tables of runs, written as Markdown, LaTeX and CSV.

One row per (model, dataset, method, budget): the paper tables compare methods at a matched budget, so rows go
full cache first, then by budget, then methods in the papers' order (FullKV, PyramidKV, SnapKV, H2O, ...).
Scores in [0, 1] are shown as 100 x mean, the convention of the PyramidKV/SnapKV/Ada-KV tables (NIAH word recall
is PyramidKV Table 15's "Acc."). Markdown and LaTeX are written here rather than by pandas, which would need the
optional tabulate and jinja2 packages, and so that the numbers are rounded the same way in both.
"""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from kvbench.metrics.stats import unit_mean_se
from kvbench.report.compare import MARK, fmt_interval, reference_key, sample_units, significant
from kvbench.report.escape import md_row, md_text, tex_escape
from kvbench.report.labels import METHOD_NAMES, method_label
from kvbench.report.settings import SETTING

METRIC_LABELS = {"pyramidkv_recall": "Acc."}       # metric -> column header in the papers
# column -> (header, format); the score column, named after its metric, is "{:.2f}"
COLUMNS = {"model": ("Model", "{}"), "dataset": ("Dataset", "{}"), "method": ("Method", "{}"),
           "budget": ("KV Size", "{:d}"), "ratio": ("Ratio", "{:.2f}"), "metric": ("Metric", "{}"),
           "n": ("n", "{:d}"), "effective_budget": ("Eff. budget", "{:.1f}"), "kv_bytes_frac": ("KV/full", "{:.3f}"),
           "bits": ("Bits", "{:.0f}"), "bytes_per_entry": ("B/entry", "{:.1f}"),
           "prefill_s": ("Prefill s", "{:.3f}"), "decode_tok_s": ("Decode tok/s", "{:.1f}"),
           "query": ("Query", "{}"), "turn_mode": ("Turns", "{}"), "setting": ("Setting", "{}"),
           "protocol": ("Protocol", "{}"), "mode": ("Mode", "{}"), "records": ("Records", "{:d}"),
           "tokens": ("Tokens", "{:d}"), "PPL": ("PPL", "{:.3f}")}  # the last row: seed-task tables
MEANS = ("effective_budget", "prefill_s", "decode_tok_s")
# uncertainty columns (kvbench.metrics.stats): in the CSV always, in Markdown/LaTeX as "mean ± se" (--stderr) and as
# one "Δ vs <reference> [95 % CI]" column (--compare)
DIFF_COLUMNS = ("diff", "diff_lo", "diff_hi", "diff_se", "diff_excludes_0", "n_paired", "reference", "resamples",
                "seed")
HIDDEN = ("se", *DIFF_COLUMNS)


def size_keys(df: pd.DataFrame) -> list[str]:
    """The columns that say how much a run kept: `budget`, and `ratio` when a run in `df` has one (a ratio run
    records no budget, each sample's comes from its prompt length, so its ratio is what tells its rows apart)."""
    return ["budget", *(["ratio"] if "ratio" in df and df["ratio"].notna().any() else [])]


def sort_runs(frame: pd.DataFrame) -> pd.DataFrame:
    """Order rows: per model and dataset, `full` first, then by budget (then ratio), then methods in paper order,
    each question-aware before question-agnostic."""
    order = {m: i for i, m in enumerate(METHOD_NAMES)}
    keys = pd.DataFrame({"not_full": frame["method"] != "full",
                         "method_order": frame["method"].map(lambda m: order.get(m, len(order))),
                         "query_order": frame["query"] != "aware" if "query" in frame else False},
                        index=frame.index)
    cols = ["model", "dataset", "not_full", "budget", "ratio", "method_order", "method", "query_order", "turn_mode",
            SETTING]
    tmp = pd.concat([frame.drop(columns=["not_full", "method_order", "query_order"], errors="ignore"), keys], axis=1)
    cols = [c for c in cols if c in tmp]
    return tmp.sort_values(cols, na_position="last", kind="stable").drop(columns=["not_full", "method_order",
                                                                                 "query_order"])


def score_scale(scores: pd.Series) -> float:
    """100 when every score lies in [0, 1] (shown as a percentage, as the papers do), else 1 (native scale)."""
    s = scores.dropna()
    return 100.0 if len(s) and s.between(0, 1).all() else 1.0


def summary_table(df: pd.DataFrame, compare=None) -> pd.DataFrame:
    """One row per (model, dataset, method, budget[, ratio][, setting]) with n (records), the primary score, its
    standard error (`se`, sd / sqrt(n) on the score's scale) and cost columns. Where a problem ran several times
    (`dataset.samples`) the problem is the unit: the score is the mean of the problems' means (pass@1) and se is over
    problems, as in the dataset's own summary (kvbench.report.compare.sample_units). With `compare` (a
    kvbench.report.compare.Compare), also each row's paired-bootstrap difference to the reference method (`diff`, `diff_lo`, `diff_hi`, ...).

    The score column is named after the primary metric ("Acc." for pyramidkv_recall); when runs with different
    primary metrics are mixed it is named "score" and a "metric" column says which. kv_bytes_frac is the total KV
    bytes held over the total a full cache would hold (the ratio of means, as in scores.json's kv_ratio); `bits`
    (per stored code) and `bytes_per_entry` (total KV bytes over total kept entries) put quantized and evicting runs
    on one memory axis (kvbench.report.bits).
    """
    df = df.copy()
    for col in ("score", "kv_bytes", "full_kv_bytes", "bits", "kv_entries", *MEANS):
        if col not in df:
            df[col] = math.nan
    df["primary_metric"] = df["primary_metric"].fillna("score") if "primary_metric" in df else "score"
    keys = ["model", "dataset", "method", *size_keys(df)]
    if "query" in df and set(df["query"].dropna()) - {"aware"}:  # aware and agnostic rows side by side
        keys.append("query")
    if "turn_mode" in df and df["turn_mode"].notna().any():  # multi-turn: append and reset conversations apart
        df["turn_mode"] = df["turn_mode"].fillna("–")
        keys.append("turn_mode")
    if SETTING in df and df[SETTING].notna().any():  # runs of one key whose settings differ: never one row
        df[SETTING] = df[SETTING].fillna("–")
        keys.append(SETTING)
    scale = {m: score_scale(g["score"]) for m, g in df.groupby("primary_metric")}
    g = df.groupby([*keys, "primary_metric"], dropna=False, sort=False)
    df["_group"] = g.ngroup()
    out = g.agg(n=("score", "size"), kv_bytes=("kv_bytes", "sum"), full_kv_bytes=("full_kv_bytes", "sum"),
                kv_entries=("kv_entries", "sum"), bits=("bits", "first"),
                _group=("_group", "first"), **{c: (c, "mean") for c in MEANS}).reset_index()
    estimates = {k: unit_mean_se(x["score"].astype(float), sample_units(x)) for k, x in df.groupby("_group")}
    out["score"] = out["_group"].map(lambda k: estimates[k].mean).astype(float)
    out["se"] = out["_group"].map(lambda k: math.nan if estimates[k].se is None else estimates[k].se).astype(float)
    out["score"] = out["score"] * out["primary_metric"].map(scale)
    out["se"] = out["se"] * out["primary_metric"].map(scale)
    if compare is not None:
        out = _add_differences(out, df, keys, scale, compare)
    out["kv_bytes_frac"] = out["kv_bytes"] / out["full_kv_bytes"].where(out["full_kv_bytes"] > 0)
    out["bytes_per_entry"] = out["kv_bytes"] / out["kv_entries"].where(out["kv_entries"] > 0)  # (report/bits.py)
    metrics = out["primary_metric"].unique()
    label = METRIC_LABELS.get(metrics[0], metrics[0]) if len(metrics) == 1 else "score"
    out = out.rename(columns={"score": label, "primary_metric": "metric"})
    cols = [*keys, *(["metric"] if len(metrics) > 1 else []), "n", label, "se", "effective_budget", "kv_bytes_frac",
            "bits", "bytes_per_entry", "prefill_s", "decode_tok_s", *(DIFF_COLUMNS if compare is not None else ())]
    out = sort_runs(out)[cols].reset_index(drop=True)
    out.attrs["score_column"] = label
    if compare is not None:
        out.attrs["notes"] = compare.note()
    return out


def _add_differences(out: pd.DataFrame, df: pd.DataFrame, keys: list[str], scale: dict, compare) -> pd.DataFrame:
    """Each row's paired difference to the reference method's row of the same model, dataset and metric (at the
    same budget, and query mode, if the reference ran at it; kvbench.report.compare.reference_key). With a query
    reference (`--compare aware`): to the same method's row at the same budget in that mode."""
    rows = []
    same = ["budget", "ratio", *(k for k in ("query", "turn_mode", SETTING) if k in keys)]
    for _, row in out.iterrows():
        by_query = compare.axis == "query"
        where = out["query"] == compare.reference if by_query else out["method"] == compare.reference
        if by_query:
            where &= out["method"] == row["method"]
        cands = out[where & (out["model"] == row["model"]) & (out["dataset"] == row["dataset"])
                    & (out["primary_metric"] == row["primary_metric"])]
        ref = reference_key(row.to_dict(), [c.to_dict() for _, c in cands.iterrows()],
                            [k for k in same if not (by_query and k == "query")])
        ci = None
        if ref is not None and row.get("query" if by_query else "method") != compare.reference:
            label = f"{method_label(row['method'])} {'' if pd.isna(row['budget']) else row['budget']}".strip()
            label += f" {row['query']}" if "query" in keys else ""
            label += f" ({row[SETTING]})" if SETTING in keys and row[SETTING] != "–" else ""
            ci = compare.cells(df[df["_group"] == row["_group"]], df[df["_group"] == ref["_group"]], label,
                               scale[row["primary_metric"]])["score"]
        rows.append({"diff": ci.diff, "diff_lo": ci.lo, "diff_hi": ci.hi, "diff_se": ci.se,
                     "diff_excludes_0": significant(ci), "n_paired": ci.n} if ci is not None else {})
    extra = pd.DataFrame(rows, index=out.index, columns=list(DIFF_COLUMNS[:6]))
    return out.assign(**extra, reference=compare.reference, resamples=compare.resamples, seed=compare.seed)


def _missing(v) -> bool:
    return v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v))


def _cells(table: pd.DataFrame, missing: str = "–",
           stderr: bool = False) -> tuple[list[str], list[list[str]], list[bool]]:
    """Headers, formatted cells and which columns are numeric (right-aligned), shared by Markdown and LaTeX.
    With `stderr` the score shows "mean ± se", as does any column X that has an "se:X" column beside it; a compared
    table gets its "Δ vs <reference>" column after the score."""
    headers, rows, numeric = [], [[] for _ in range(len(table))], []
    score_col = table.attrs.get("score_column")
    marks = table.attrs.get("marks", {})        # (row index, column) -> interval excluding 0 (seed-task tables)
    for col in table.columns:
        if col in HIDDEN or str(col).split(":")[0] in ("se", "diff", "lo", "hi"):   # shown inside the cell, or CSV
            continue
        header, fmt = COLUMNS.get(col, (col, "{:.2f}"))
        headers.append(header)
        numeric.append(pd.api.types.is_numeric_dtype(table[col]))
        for row, (_, r) in zip(rows, table.iterrows()):
            v = r[col]
            if _missing(v):
                row.append(missing)
            elif col == "method":
                row.append(method_label(v))
            else:
                cell = fmt.format(int(v) if fmt == "{:d}" else v)
                se_col = "se" if col == score_col else f"se:{col}"
                if stderr and se_col in r and not _missing(r[se_col]):
                    cell += " ± " + fmt.format(r[se_col])
                row.append(cell + (MARK if (r.name, col) in marks else ""))
        if col == score_col and "diff" in table:
            from kvbench.metrics.stats import Interval

            ref = method_label(table["reference"].iloc[0]) if len(table) else ""
            headers.append(f"Δ vs {ref} [95% CI]")
            numeric.append(True)
            for row, (_, r) in zip(rows, table.iterrows()):
                ci = None if _missing(r["diff"]) else Interval(r["diff"], r["diff_lo"], r["diff_hi"], r["diff_se"],
                                                               int(r["n_paired"]), 0.95, int(r["resamples"]),
                                                               int(r["seed"]))
                row.append(missing if ci is None else fmt_interval(ci))
    return headers, rows, numeric


def to_markdown(table: pd.DataFrame, stderr: bool = False) -> str:
    """A GitHub-flavoured Markdown table, numbers right-aligned; `stderr` shows "mean ± se"; a compared table's
    note (mark, resamples, seed, unpaired samples) follows it."""
    headers, rows, numeric = _cells(table, stderr=stderr)
    lines = [md_row(headers), "|" + "|".join("---:" if num else ":---" for num in numeric) + "|"]
    lines += [md_row(r) for r in rows]
    notes = [md_text(n) for n in table.attrs.get("notes", [])]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def to_latex(table: pd.DataFrame, stderr: bool = False) -> str:
    """A booktabs `tabular` (needs \\usepackage{booktabs}), ready to \\input into a paper; `stderr` and a compared
    table's note as in `to_markdown` (the note as a last row spanning the table)."""
    headers, rows, numeric = _cells(table, missing="--", stderr=stderr)
    lines = [r"\begin{tabular}{" + "".join("r" if num else "l" for num in numeric) + "}", r"\toprule",
             " & ".join(map(tex_escape, headers)) + r" \\", r"\midrule"]
    lines += [" & ".join(map(tex_escape, r)) + r" \\" for r in rows]
    lines.append(r"\bottomrule")
    lines += [rf"\multicolumn{{{len(headers)}}}{{l}}{{\footnotesize {tex_escape(n)}}} \\"
              for n in table.attrs.get("notes", [])]
    lines.append(r"\end{tabular}")
    return "\n".join(lines) + "\n"


def write_tables(table: pd.DataFrame, out_dir: str | Path, stem: str = "table", stderr: bool = False) -> list[Path]:
    """Write `{stem}.md`, `{stem}.tex` and `{stem}.csv` (full precision, registry names, se and difference columns
    always) into out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.{ext}" for ext in ("md", "tex", "csv")]
    paths[0].write_text(to_markdown(table, stderr), encoding="utf-8")
    paths[1].write_text(to_latex(table, stderr), encoding="utf-8")
    table.to_csv(paths[2], index=False)
    return paths
