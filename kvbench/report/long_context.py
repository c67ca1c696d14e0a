"""Tables of LongBench v2, ZeroSCROLLS and LooGLE runs from prediction records, one row per (model, dataset, method,
KV size, query mode):
- longbench_v2: THUDM/LongBench's result.py columns (Overall, Easy, Hard, Short, Medium, Long: 100 x mean accuracy
  over the questions of each group, rounded to one decimal as result.py);
- zero_scrolls, loogle: each task's primary score x 100 (`meta.task`) and "Avg." (their plain mean).

    python -m kvbench.report results/longbench_v2 --out results/report    # writes <dataset>_table.{md,csv}
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from kvbench.metrics.stats import mean_se
from kvbench.report.tables import sort_runs, to_markdown

KEYS = ["model", "dataset", "method", "budget", "ratio", "query"]
V2_GROUPS = {"Overall": lambda g: g.index == g.index, "Easy": lambda g: g["meta.difficulty"] == "easy",
             "Hard": lambda g: g["meta.difficulty"] != "easy", "Short": lambda g: g["meta.length"] == "short",
             "Medium": lambda g: g["meta.length"] == "medium",
             "Long": lambda g: ~g["meta.length"].isin(["short", "medium"])}


def _cells(scores: pd.Series) -> tuple[float | None, float | None]:
    """100 x mean and 100 x its se (None for no scores)."""
    if scores.empty:
        return None, None
    est = mean_se(scores.astype(float))
    return 100 * est.mean, None if est.se is None else 100 * est.se


def run_table(df: pd.DataFrame) -> pd.DataFrame:
    df = df.assign(query=df["query"].fillna("aware") if "query" in df else "aware")
    rows = []
    for key, g in df.groupby(KEYS, dropna=False, sort=False):
        row = dict(zip(KEYS, key), n=len(g))
        if key[1] == "longbench_v2":
            for name, select in V2_GROUPS.items():
                mean, se = _cells(g.loc[select(g), "scores.accuracy"])
                row[name], row[f"se:{name}"] = None if mean is None else round(mean, 1), se
        else:
            tasks = list(dict.fromkeys(g["meta.task"]))
            for task in tasks:
                row[task], row[f"se:{task}"] = _cells(g.loc[g["meta.task"] == task, "score"])
            row["Avg."] = sum(row[t] for t in tasks) / len(tasks) if tasks else None
        rows.append(row)
    table = sort_runs(pd.DataFrame(rows)).reset_index(drop=True)
    se = [c for c in table.columns if str(c).startswith("se:")]
    return table[[c for c in table.columns if c not in se] + se]


def write_reports(df: pd.DataFrame, out: str | Path, stderr: bool = False) -> list[Path]:
    """`<dataset>_table.md/.csv` per dataset present (printed too); `stderr` shows "mean ± se" in the Markdown."""
    out = Path(out)
    written = []
    for dataset in sorted(df["dataset"].dropna().astype(str).unique()):
        table = run_table(df[df["dataset"] == dataset]).dropna(axis=1, how="all")
        out.mkdir(parents=True, exist_ok=True)
        md = f"## {dataset}\n\n" + to_markdown(table, stderr)
        (out / f"{dataset}_table.md").write_text(md, encoding="utf-8")
        table.to_csv(out / f"{dataset}_table.csv", index=False)
        print(md)
        written += [out / f"{dataset}_table.md", out / f"{dataset}_table.csv"]
    return written
