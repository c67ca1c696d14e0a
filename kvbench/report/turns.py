"""Multi-turn runs (`dataset=niah_multiturn`): accuracy by turn and needle depth, one heatmap per run.

A needle that survives compression for the first question may be gone, or crowded out by the conversation, by the
last: the columns are the turns in the order they were asked, the rows the depth of the needle each asked for.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from kvbench.report.heatmap import DEPTH, FONT, _draw, _save, _vmax, run_caption

TURN = "meta.turn"


def has_turns(df: pd.DataFrame) -> bool:
    return TURN in df and DEPTH in df and bool(df[TURN].notna().any())


def turn_matrix(df: pd.DataFrame) -> pd.DataFrame:
    """Mean score per cell: index = depth percent ascending, columns = turn index ascending; NaN = no record."""
    cells = df.dropna(subset=[TURN, DEPTH]).astype({"score": float, TURN: int})
    return cells.pivot_table(index=DEPTH, columns=TURN, values="score", aggfunc="mean").sort_index().sort_index(axis=1)


def turn_heatmap(df_one_run: pd.DataFrame, path: str | Path) -> Figure:
    """Draw one run's accuracy by turn (x) and depth (y) to `path`."""
    matrix = turn_matrix(df_one_run)
    fig = Figure(figsize=(max(6.0, 1.2 * matrix.shape[1] + 3), 6), layout="constrained")
    ax = fig.subplots()
    im = _draw(ax, matrix, _vmax(df_one_run["score"].astype(float)), xlabel=False)
    ax.set_xlabel("Turn", fontsize=FONT)
    fig.colorbar(im, ax=ax).set_label("Score", fontsize=FONT)
    mode = df_one_run["turn_mode"].iloc[0] if "turn_mode" in df_one_run else ""
    query = df_one_run["query"].iloc[0] if "query" in df_one_run else ""
    ax.set_title(f"{df_one_run['model'].iloc[0]}: turns ({mode}, {query})\n{run_caption(df_one_run, stderr=True)}",
                 fontsize=FONT)
    _save(fig, path)
    return fig
