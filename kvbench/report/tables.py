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

# registry name -> name in the papers; the order is the column order of the papers' tables
METHOD_NAMES = {"full": "FullKV", "pyramidkv": "PyramidKV", "snapkv": "SnapKV", "h2o": "H2O",
                "streamingllm": "StreamingLLM", "adakv": "Ada-KV", "keyformer": "Keyformer", "buzz": "BUZZ",
                "tailorkv": "TailorKV", "tailorkv-1": "TailorKV-1", "tailorkv-2": "TailorKV-2"}
METRIC_LABELS = {"pyramidkv_recall": "Acc."}       # metric -> column header in the papers
# column -> (header, format); the score column, named after its metric, is "{:.2f}"
COLUMNS = {"model": ("Model", "{}"), "dataset": ("Dataset", "{}"), "method": ("Method", "{}"),
           "budget": ("KV Size", "{:d}"), "ratio": ("Ratio", "{:.2f}"), "metric": ("Metric", "{}"),
           "n": ("n", "{:d}"), "effective_budget": ("Eff. budget", "{:.1f}"), "kv_bytes_frac": ("KV/full", "{:.3f}"),
           "prefill_s": ("Prefill s", "{:.3f}"), "decode_tok_s": ("Decode tok/s", "{:.1f}")}
MEANS = ("effective_budget", "prefill_s", "decode_tok_s")


def method_label(name: str) -> str:
    """The paper's spelling of a method (`h2o` -> `H2O`); unknown methods keep their registry name."""
    return METHOD_NAMES.get(name, name)


def sort_runs(frame: pd.DataFrame) -> pd.DataFrame:
    """Order rows: per model and dataset, `full` first, then by budget (then ratio), then methods in paper order."""
    order = {m: i for i, m in enumerate(METHOD_NAMES)}
    keys = pd.DataFrame({"not_full": frame["method"] != "full",
                         "method_order": frame["method"].map(lambda m: order.get(m, len(order)))}, index=frame.index)
    cols = ["model", "dataset", "not_full", "budget", "ratio", "method_order", "method"]
    tmp = pd.concat([frame.drop(columns=["not_full", "method_order"], errors="ignore"), keys], axis=1)
    cols = [c for c in cols if c in tmp]
    return tmp.sort_values(cols, na_position="last", kind="stable").drop(columns=["not_full", "method_order"])


def score_scale(scores: pd.Series) -> float:
    """100 when every score lies in [0, 1] (shown as a percentage, as the papers do), else 1 (native scale)."""
    s = scores.dropna()
    return 100.0 if len(s) and s.between(0, 1).all() else 1.0


def summary_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (model, dataset, method, budget[, ratio]) with n, the primary score and cost columns.

    The score column is named after the primary metric ("Acc." for pyramidkv_recall); when runs with different
    primary metrics are mixed it is named "score" and a "metric" column says which. kv_bytes_frac is the total KV
    bytes held over the total a full cache would hold (the ratio of means, as in scores.json's kv_ratio).
    """
    df = df.copy()
    for col in ("score", "kv_bytes", "full_kv_bytes", *MEANS):
        if col not in df:
            df[col] = math.nan
    df["primary_metric"] = df["primary_metric"].fillna("score") if "primary_metric" in df else "score"
    keys = ["model", "dataset", "method", "budget"] + (["ratio"] if "ratio" in df and df["ratio"].notna().any() else [])
    scale = {m: score_scale(g["score"]) for m, g in df.groupby("primary_metric")}
    g = df.groupby([*keys, "primary_metric"], dropna=False, sort=False)
    out = g.agg(n=("score", "size"), score=("score", "mean"), kv_bytes=("kv_bytes", "sum"),
                full_kv_bytes=("full_kv_bytes", "sum"), **{c: (c, "mean") for c in MEANS}).reset_index()
    out["score"] = out["score"] * out["primary_metric"].map(scale)
    out["kv_bytes_frac"] = out["kv_bytes"] / out["full_kv_bytes"].where(out["full_kv_bytes"] > 0)
    metrics = out["primary_metric"].unique()
    label = METRIC_LABELS.get(metrics[0], metrics[0]) if len(metrics) == 1 else "score"
    out = out.rename(columns={"score": label, "primary_metric": "metric"})
    cols = [*keys, *(["metric"] if len(metrics) > 1 else []), "n", label, "effective_budget", "kv_bytes_frac",
            "prefill_s", "decode_tok_s"]
    out = sort_runs(out)[cols].reset_index(drop=True)
    out.attrs["score_column"] = label
    return out


def _cells(table: pd.DataFrame, missing: str = "–") -> tuple[list[str], list[list[str]], list[bool]]:
    """Headers, formatted cells and which columns are numeric (right-aligned), shared by Markdown and LaTeX."""
    headers, rows, numeric = [], [[] for _ in range(len(table))], []
    for col in table.columns:
        header, fmt = COLUMNS.get(col, (col, "{:.2f}"))
        headers.append(header)
        numeric.append(pd.api.types.is_numeric_dtype(table[col]))
        for row, v in zip(rows, table[col]):
            if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)):
                row.append(missing)
            elif col == "method":
                row.append(method_label(v))
            else:
                row.append(fmt.format(int(v) if fmt == "{:d}" else v))
    return headers, rows, numeric


def to_markdown(table: pd.DataFrame) -> str:
    """A GitHub-flavoured Markdown table, numbers right-aligned."""
    headers, rows, numeric = _cells(table)
    esc = lambda s: s.replace("|", r"\|")  # noqa: E731
    lines = ["| " + " | ".join(map(esc, headers)) + " |",
             "|" + "|".join("---:" if num else ":---" for num in numeric) + "|"]
    lines += ["| " + " | ".join(map(esc, r)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


_TEX_ESCAPES = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}


def tex_escape(text: str) -> str:
    """Escape LaTeX's special characters (method and dataset names often contain `_`)."""
    return "".join(_TEX_ESCAPES.get(ch, ch) for ch in text)


def to_latex(table: pd.DataFrame) -> str:
    """A booktabs `tabular` (needs \\usepackage{booktabs}), ready to \\input into a paper."""
    headers, rows, numeric = _cells(table, missing="--")
    lines = [r"\begin{tabular}{" + "".join("r" if num else "l" for num in numeric) + "}", r"\toprule",
             " & ".join(map(tex_escape, headers)) + r" \\", r"\midrule"]
    lines += [" & ".join(tex_escape(c) for c in r) + r" \\" for r in rows]
    lines += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(lines) + "\n"


def write_tables(table: pd.DataFrame, out_dir: str | Path, stem: str = "table") -> list[Path]:
    """Write `{stem}.md`, `{stem}.tex` and `{stem}.csv` (full precision, registry names) into out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.{ext}" for ext in ("md", "tex", "csv")]
    paths[0].write_text(to_markdown(table), encoding="utf-8")
    paths[1].write_text(to_latex(table), encoding="utf-8")
    table.to_csv(paths[2], index=False)
    return paths
