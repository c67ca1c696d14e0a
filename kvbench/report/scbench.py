"""SCBench table from prediction records (one record per turn): per (model, mode, turn mode, query, method, KV size)
each task's score x 100 over all its turns, "Avg." (the mean of the task columns), and each task's score at every turn (`<task> T1`,
`T2`, ...: upstream's per-turn accuracy, where multi-turn collapse shows).

    python -m kvbench.report results/scbench --out results/report    # writes scbench_table.{md,csv}
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from kvbench.metrics.stats import mean_se, stratified_mean_se
from kvbench.report.tables import size_keys, sort_runs, to_markdown

KEYS = ["model", "mode", "turn_mode", "query", "method"]  # and the size columns (tables.size_keys: budget, ratio)
LABELS = {"scbench_kv": "Retr.KV", "scbench_prefix_suffix": "Retr.Prefix-Suffix", "scbench_qa_eng": "En.QA",
          "scbench_choice_eng": "En.MultiChoice", "scbench_many_shot": "ICL.ManyShot", "scbench_summary": "En.Sum"}


def _se100(values: pd.Series) -> float | None:
    se = mean_se(values.astype(float)).se
    return None if se is None else 100 * se


def scbench_table(df: pd.DataFrame) -> pd.DataFrame:
    df = df.assign(mode=df["meta.mode"] if "meta.mode" in df else None,  # turn_mode "-": a sample per turn
                   turn_mode=df["turn_mode"].fillna("-") if "turn_mode" in df else "-",
                   query=df["query"].fillna("aware") if "query" in df else "aware")
    rows = []
    keys = [*KEYS, *size_keys(df)]
    for key, g in df.groupby(keys, dropna=False, sort=False):
        row = dict(zip(keys, key), n=len(g))
        tasks = [t for t in LABELS if t in set(g["meta.task"])]
        for task in tasks:
            t = g[g["meta.task"] == task]
            row[LABELS[task]] = 100 * t["score"].astype(float).mean()
            row[f"se:{LABELS[task]}"] = _se100(t["score"])
        row["Avg."] = sum(row[LABELS[t]] for t in tasks) / len(tasks) if tasks else None
        se = stratified_mean_se(g["score"].astype(float), g["meta.task"]).se
        row["se:Avg."] = None if se is None else 100 * se
        for task in tasks:
            t = g[g["meta.task"] == task]
            for turn, s in sorted(t.groupby("meta.turn")["score"], key=lambda kv: kv[0]):
                row[f"{LABELS[task]} T{int(turn) + 1}"] = 100 * s.astype(float).mean()
        rows.append(row)
    table = sort_runs(pd.DataFrame(rows)).reset_index(drop=True)
    se = [c for c in table.columns if str(c).startswith("se:")]
    return table[[c for c in table.columns if c not in se] + se]


def write_reports(df: pd.DataFrame, out: str | Path, stderr: bool = False) -> list[Path]:
    """`scbench_table.md/.csv` (printed too); `stderr` shows "mean ± se" in the Markdown."""
    df = df[df["dataset"] == "scbench"]
    if df.empty:
        return []
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    table = scbench_table(df)
    md = "## scbench\n\n" + to_markdown(table, stderr)
    (out / "scbench_table.md").write_text(md, encoding="utf-8")
    table.to_csv(out / "scbench_table.csv", index=False)
    print(md)
    return [out / "scbench_table.md", out / "scbench_table.csv"]
