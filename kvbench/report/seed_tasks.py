"""Tables for the seed papers' other evaluations, one per dataset, rebuilt from prediction records only.

    python -m kvbench.report results/ --out results/report   # dispatches here for the five datasets below

- `cnn_dailymail`, `xsum`: per (model, protocol, method, KV size): Keyformer's ROUGE-1/2/L/Lsum (rouge_score,
  stemmed, mean of per-sample F x 100), BUZZ's R-1/R-2/R-L (pltrdy `rouge`, x 100) and their geometric "Mean"
  (BUZZ Table 2), and Self-BLEU x 100 where scored.
- `lost_in_the_middle`: best_subspan_em x 100 per gold position and their average (BUZZ Fig. 6).
- `wikitext_ppl`: PPL = exp(total NLL / total tokens) per (mode, method, KV size) (BUZZ Table 3).
- `infinitebench`: one column per task (its own metric x 100) and "Avg." = the mean of the task columns
  (TailorKV Table 15).
Each table is written as `<dataset>_table.{md,csv}` and printed. Every score has its standard error beside it
(`se:<column>`, same scale; in the CSV always, in the Markdown as "mean ± se" with `--stderr`): sd / sqrt(n) for
means over samples, the se of the average of group means for "Avg." (kvbench.metrics.stats.stratified_mean_se), and a
seeded bootstrap over records for BUZZ's geometric Mean and for PPL, which are not means over samples. With
`--compare METHOD` each cell also gets its paired-bootstrap difference to that method (`diff:`/`lo:`/`hi:` columns)
and a † where the 95 % interval excludes 0 (kvbench.report.compare).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from kvbench.metrics.stats import exp_of_ratio, geometric_mean_of_means, mean_se, stratified_mean_se
from kvbench.metrics.summarization import mean_rouge
from kvbench.report.labels import method_label
from kvbench.report.tables import size_keys, sort_runs, to_markdown

DATASETS = ("cnn_dailymail", "xsum", "lost_in_the_middle", "wikitext_ppl", "infinitebench")


def run_keys(df: pd.DataFrame) -> list[str]:
    """A row's configuration: model, method and KV size (budget, and ratio where a run has one: BUZZ's sweeps)."""
    return ["model", "method", *size_keys(df)]


def _col(df: pd.DataFrame, name: str) -> pd.Series:
    return df[name] if name in df else pd.Series([None] * len(df), index=df.index)


def summarization_table(df: pd.DataFrame) -> pd.DataFrame:
    rows, keys = [], [*run_keys(df), "protocol"]
    df = df.assign(protocol=_col(df, "meta.protocol"))
    for key, g in df.groupby(keys, dropna=False, sort=False):
        row = dict(zip(keys, key), n=len(g))
        for k in ("rouge1", "rouge2", "rougeL", "rougeLsum"):
            row[f"KF {k}"] = round(100 * g[f"scores.{k}"].astype(float).mean(), 4)
            row[f"se:KF {k}"] = _se100(g[f"scores.{k}"])
        buzz_cols = [f"scores.buzz_{k}" for k in ("rouge1", "rouge2", "rougeL")]
        buzz = [100 * g[c].astype(float).mean() for c in buzz_cols]
        row.update({"BUZZ R-1": buzz[0], "BUZZ R-2": buzz[1], "BUZZ R-L": buzz[2], "BUZZ Mean": mean_rouge(*buzz)})
        row.update({f"se:BUZZ {name}": _se100(g[c]) for name, c in zip(("R-1", "R-2", "R-L"), buzz_cols)})
        geo = geometric_mean_of_means(*buzz_cols).estimate(g[buzz_cols].to_numpy(dtype=float))["se"]
        row["se:BUZZ Mean"] = None if geo is None else 100 * geo
        if "scores.self_bleu" in g and g["scores.self_bleu"].notna().all():
            row["Self-BLEU"] = 100 * g["scores.self_bleu"].astype(float).mean()
            row["se:Self-BLEU"] = _se100(g["scores.self_bleu"])
        rows.append(row)
    return sort_runs(pd.DataFrame(rows)).reset_index(drop=True)


def qa_table(df: pd.DataFrame) -> pd.DataFrame:
    rows, keys = [], run_keys(df)
    for key, g in df.groupby(keys, dropna=False, sort=False):
        row = dict(zip(keys, key), n=len(g))
        groups = g.groupby("meta.gold_position")["scores.best_subspan_em"]
        per = groups.mean() * 100
        row.update({f"gold@{int(p)}": v for p, v in per.items()})
        row["Avg."] = per.mean()
        row.update({f"se:gold@{int(p)}": _se100(v) for p, v in groups})
        row["se:Avg."] = _avg_se100(g["scores.best_subspan_em"], g["meta.gold_position"])
        rows.append(row)
    return sort_runs(pd.DataFrame(rows)).reset_index(drop=True)


def perplexity_table(df: pd.DataFrame) -> pd.DataFrame:
    rows, keys = [], [*run_keys(df), "mode"]
    df = df.assign(mode=_col(df, "meta.task"))
    for key, g in df.groupby(keys, dropna=False, sort=False):
        nll, n = g["nll_sum"].sum(), g["n_tokens"].sum()
        ppl_se = exp_of_ratio("nll_sum", "n_tokens").estimate(g[["nll_sum", "n_tokens"]].to_numpy(dtype=float))["se"]
        rows.append({**dict(zip(keys, key)), "records": len(g), "tokens": int(n),
                     "PPL": math.exp(nll / n) if n else math.nan,
                     "kv_bytes_frac": g["kv_bytes"].sum() / g["full_kv_bytes"].sum(), "se:PPL": ppl_se})
    return sort_runs(pd.DataFrame(rows)).reset_index(drop=True)


def task_table(df: pd.DataFrame) -> pd.DataFrame:
    rows, keys = [], run_keys(df)
    for key, g in df.groupby(keys, dropna=False, sort=False):
        row = dict(zip(keys, key), n=len(g))
        per = g.groupby("meta.task", sort=False)["score"].mean() * 100
        row.update(per.to_dict())
        row["Avg."] = per.mean()
        row.update({f"se:{t}": _se100(v) for t, v in g.groupby("meta.task", sort=False)["score"]})
        row["se:Avg."] = _avg_se100(g["score"], g["meta.task"])
        rows.append(row)
    return sort_runs(pd.DataFrame(rows)).reset_index(drop=True)


def _se100(values: pd.Series) -> float | None:
    """sd / sqrt(n) x 100 of per-sample scores in [0, 1]."""
    se = mean_se(values.astype(float)).se
    return None if se is None else 100 * se


def _avg_se100(values: pd.Series, groups: pd.Series) -> float | None:
    """The se (x 100) of the plain mean of group means ("Avg."), from the samples of every group."""
    se = stratified_mean_se(values.astype(float), groups).se
    return None if se is None else 100 * se


def _ordered(table: pd.DataFrame) -> pd.DataFrame:
    """Move the se columns to the end, so the CSV reads like the Markdown with its uncertainty after it."""
    se = [c for c in table.columns if str(c).startswith("se:")]
    return table[[c for c in table.columns if c not in se] + se]


# --- --compare: each score cell against the reference method's row, paired by sample id ---------------------------
BUZZ_MEAN = ["scores.buzz_rouge1", "scores.buzz_rouge2", "scores.buzz_rougeL"]
SUMMARY_CELLS = {**{f"KF {k}": [f"scores.{k}"] for k in ("rouge1", "rouge2", "rougeL", "rougeLsum")},
                 **{f"BUZZ {n}": [c] for n, c in zip(("R-1", "R-2", "R-L"), BUZZ_MEAN)},
                 "Self-BLEU": ["scores.self_bleu"]}


def _mean_of_column(x: np.ndarray) -> np.ndarray:
    return x[..., 0].mean(axis=-1)


def _row_cells(dataset: str, row: pd.Series, m: pd.DataFrame, r: pd.DataFrame, label: str, compare) -> dict:
    """Intervals (method - reference) for every score cell of one row of `dataset`'s table."""
    if dataset in ("cnn_dailymail", "xsum"):
        out = {c: compare.statistic_cell(m, r, label, cols, _mean_of_column, 100.0)
               for c, cols in SUMMARY_CELLS.items() if c in row and all(k in m for k in cols)}
        geometric = geometric_mean_of_means(*BUZZ_MEAN).statistic
        out["BUZZ Mean"] = compare.statistic_cell(m, r, label, BUZZ_MEAN, geometric, 100.0)
        return out
    if dataset == "wikitext_ppl":
        ppl = exp_of_ratio("nll_sum", "n_tokens")
        return {"PPL": compare.statistic_cell(m, r, label, list(ppl.columns), ppl.statistic)}
    if dataset == "lost_in_the_middle":
        m, r = (x.assign(score=x["scores.best_subspan_em"]) for x in (m, r))
        positions = sorted(m["meta.gold_position"].dropna().unique())
        cells = compare.cells(m, r, label, 100.0, "meta.gold_position", positions)
        return {("Avg." if p == "Avg." else f"gold@{int(p)}"): ci for p, ci in cells.items()}
    tasks = [t for t in m["meta.task"].dropna().unique() if t in row]
    return compare.cells(m, r, label, 100.0, "meta.task", tasks)


def add_differences(table: pd.DataFrame, df: pd.DataFrame, dataset: str, compare) -> pd.DataFrame:
    """`diff:`, `lo:`, `hi:` columns and attrs["marks"] / attrs["notes"] for a seed-task table (see
    kvbench.report.compare): rows pair with the reference method's row of the same model (protocol, mode) and KV
    size, or with the full cache at any size."""
    from kvbench.report.compare import reference_key, select, significant

    extra_keys = {"cnn_dailymail": "protocol", "xsum": "protocol", "wikitext_ppl": "mode"}.get(dataset)
    keys = [*run_keys(df), *([extra_keys] if extra_keys else [])]
    records = df.assign(protocol=_col(df, "meta.protocol"), mode=_col(df, "meta.task"))
    extra, marks = [], {}
    for i, row in table.iterrows():
        same = table[(table["method"] == compare.reference) & (table["model"] == row["model"])]
        if extra_keys:
            same = same[same[extra_keys].astype(str) == str(row[extra_keys])]
        ref = reference_key(row.to_dict(), [c.to_dict() for _, c in same.iterrows()], size_keys(df))
        cis = {}
        if ref is not None and row["method"] != compare.reference:
            size = (f"r{row['ratio']:g}" if pd.notna(row.get("ratio", None)) else
                    "" if pd.isna(row["budget"]) else str(int(row["budget"])))
            label = f"{method_label(row['method'])} {size}".strip()
            cis = _row_cells(dataset, row, select(records, row, keys), select(records, ref, keys), label, compare)
        extra.append({f"{k}:{c}": getattr(ci, k, None) for c, ci in cis.items() for k in ("diff", "lo", "hi")})
        marks |= {(i, c): ci for c, ci in cis.items() if significant(ci)}
    out = pd.concat([table, pd.DataFrame(extra, index=table.index)], axis=1)
    out.attrs.update(table.attrs, marks=marks, notes=compare.note())
    return out


BUILDERS = {"cnn_dailymail": summarization_table, "xsum": summarization_table, "lost_in_the_middle": qa_table,
            "wikitext_ppl": perplexity_table, "infinitebench": task_table}


def write_reports(df: pd.DataFrame, out: str | Path, stderr: bool = False, compare=None) -> list[Path]:
    """`<dataset>_table.md/.csv` for every seed-task dataset in `df` (one block per model); prints each table.
    The CSV always has the se columns; `stderr` shows "mean ± se" in the Markdown; `compare` (a
    kvbench.report.compare.Compare) adds each cell's paired-bootstrap difference to the reference and its mark."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for dataset in sorted(d for d in df["dataset"].dropna().unique() if d in BUILDERS):
        table = _ordered(BUILDERS[dataset](df[df["dataset"] == dataset]))
        if compare is not None:
            compare.unpaired.clear()
            table = add_differences(table, df[df["dataset"] == dataset], dataset, compare)
        md = f"## {dataset}\n\n" + to_markdown(table, stderr)
        (out / f"{dataset}_table.md").write_text(md, encoding="utf-8")
        table.to_csv(out / f"{dataset}_table.csv", index=False)
        written += [out / f"{dataset}_table.md", out / f"{dataset}_table.csv"]
        print(md)
    return written
