"""Needle-in-a-haystack heatmaps drawn the way PyramidKV's `scripts/scripts_needle/visualize.py` draws them.

Rows are depth percent (0 at the top), columns context length, colour the mean primary score of the cell on a fixed
0..1 red -> amber -> green scale, so heatmaps of different methods and budgets can be compared by eye, as in the
paper's stacked Figs. 4 and 9-17. Drawn with matplotlib alone (no seaborn) on `Figure` objects rather than pyplot,
so that a runner, a notebook or a test can call these in any process without touching global backend state.
"""
from __future__ import annotations

import logging
import string
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.colors import LinearSegmentedColormap
from matplotlib.figure import Figure

from kvbench.metrics.stats import mean_se
from kvbench.report.labels import method_label
from kvbench.report.tables import score_scale, sort_runs

logger = logging.getLogger(__name__)

CMAP = LinearSegmentedColormap.from_list("custom_cmap", ["#F0496E", "#EBB839", "#0CD79F"])   # PyramidKV's colours
TITLE = 'Pressure Testing {model} \nFact Retrieval Across Context Lengths ("Needle In A HayStack")'
LENGTH, DEPTH = "meta.context_length", "meta.depth_percent"   # record meta written by the NIAH builder
DPI = 150
FONT = 14                  # PyramidKV used 18 on a 38-inch-wide figure


def has_needle_grid(df: pd.DataFrame) -> bool:
    """True when the records carry NIAH's context length and depth, i.e. a heatmap can be drawn."""
    return LENGTH in df and DEPTH in df and bool((df[LENGTH].notna() & df[DEPTH].notna()).any())


def needle_matrix(df: pd.DataFrame) -> pd.DataFrame:
    """Mean score per cell: index = depth percent ascending, columns = context length ascending; NaN = no record."""
    cells = df.dropna(subset=[LENGTH, DEPTH]).astype({"score": float})
    m = cells.pivot_table(index=DEPTH, columns=LENGTH, values="score", aggfunc="mean")
    return m.sort_index(axis=0).sort_index(axis=1)


def run_caption(df_run: pd.DataFrame, stderr: bool = False) -> str:
    """The paper's panel caption, e.g. "PyramidKV, KV Size=64, acc 80.5"; acc = 100 x mean score if in [0, 1].
    With `stderr`, "acc 80.5 ± 3.2 (n=50)": the standard error over the run's samples."""
    row = df_run.iloc[0]
    est = mean_se(df_run["score"].astype(float)).scaled(score_scale(df_run["score"].astype(float)))
    acc = est.mean
    parts = [method_label(row["method"])]
    if row["method"] != "full" and pd.notna(row.get("budget")):
        parts.append(f"KV Size={int(row['budget'])}")
    if pd.notna(row.get("ratio")):
        parts.append(f"ratio={float(row['ratio']):g}")
    if isinstance(row.get("setting"), str):  # another run has the same method and size (kvbench.report.settings)
        parts.append(row["setting"])
    if stderr:
        return ", ".join(parts) + f", acc {acc:.1f}" + ("" if est.se is None else f" ± {est.se:.1f}") + f" (n={est.n})"
    return ", ".join(parts) + f", acc {acc:.1f}"


def _tick(v: float) -> str:
    return f"{int(v)}" if float(v).is_integer() else f"{v:g}"


def _draw(ax, matrix: pd.DataFrame, vmax: float, xlabel: bool = True):
    """Draw one heatmap into ax; missing cells stay blank (masked), cell borders are thin grey dashed lines."""
    data = np.ma.masked_invalid(matrix.to_numpy(dtype=float))
    im = ax.imshow(data, cmap=CMAP, vmin=0.0, vmax=vmax, aspect="auto", interpolation="nearest")
    n_rows, n_cols = data.shape
    ax.set_xticks(range(n_cols), [_tick(v) for v in matrix.columns], rotation=45, ha="right")
    ax.set_yticks(range(n_rows), [_tick(v) for v in matrix.index], rotation=0)
    ax.set_xticks(np.arange(n_cols + 1) - 0.5, minor=True)
    ax.set_yticks(np.arange(n_rows + 1) - 0.5, minor=True)
    ax.grid(which="minor", color="grey", linestyle="--", linewidth=0.5)
    ax.grid(which="major", visible=False)
    ax.tick_params(which="minor", length=0)
    ax.tick_params(which="major", labelsize=FONT - 4)
    if xlabel:
        ax.set_xlabel("Token Limit", fontsize=FONT)
    ax.set_ylabel("Depth Percent", fontsize=FONT)
    return im


def _vmax(scores: pd.Series) -> float:
    """1.0, PyramidKV's fixed scale; a metric on another scale (e.g. ROUGE x 10) gets its own maximum instead."""
    top = float(scores.max()) if len(scores.dropna()) else 1.0
    if top > 1.0:
        logger.warning("report: scores exceed 1 (max %.3g); heatmap colour scale set to 0..%.3g", top, top)
        return top
    return 1.0


def _width(n_cols: int) -> float:
    return min(38.0, max(8.0, 0.35 * n_cols + 3.0))   # PyramidKV used 38 in for 71 lengths


def _save(fig: Figure, path: str | Path) -> None:
    """The suffix picks the format (.png, .pdf, .svg)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, facecolor="white")


def needle_heatmap(df_one_run: pd.DataFrame, path: str | Path, title: str | None = None,
                   pretrained_len: int | None = None) -> Figure:
    """Draw one run's NIAH grid to `path` and return the figure.

    The default title is PyramidKV's plus a line with method, budget, acc and its standard error. With
    `pretrained_len`, a white dashed line marks the border before the first context length above it (PyramidKV's
    pretraining-length marker).
    """
    if df_one_run["run_dir"].nunique() > 1:
        raise ValueError(f"needle_heatmap: expects the records of one run, got {df_one_run['run_dir'].nunique()} "
                         "runs; filter by run_dir or use needle_panels")
    if not has_needle_grid(df_one_run):
        raise ValueError("needle_heatmap: records have no meta.context_length/meta.depth_percent (not a NIAH run)")
    matrix = needle_matrix(df_one_run)
    fig = Figure(figsize=(_width(matrix.shape[1]), 8), layout="constrained")
    ax = fig.subplots()
    im = _draw(ax, matrix, _vmax(df_one_run["score"].astype(float)))
    fig.colorbar(im, ax=ax).set_label("Score", fontsize=FONT)
    if pretrained_len is not None:
        beyond = [i for i, n in enumerate(matrix.columns) if n > pretrained_len]
        if beyond:
            ax.axvline(beyond[0] - 0.5, color="white", linestyle="--", linewidth=4)
    model = df_one_run["model"].iloc[0]
    default = TITLE.format(model=model) + "\n" + run_caption(df_one_run, stderr=True)
    ax.set_title(title if title is not None else default, fontsize=FONT + 2)
    _save(fig, path)
    return fig


def _context_size(lengths: pd.Series) -> str:
    return f"{float(lengths.max()) / 1000:g}K"


def needle_panels(df: pd.DataFrame, path: str | Path, title: str | None = None, stderr: bool = False) -> Figure:
    """Stack one heatmap per run (full first, then by budget, methods in paper order), as in PyramidKV Figs. 4, 9-17.

    Each panel is captioned "(a) PyramidKV, KV Size=64, acc 80.5"; the super-title is "{model} - 8K Context Size"
    when all runs share a model; `stderr` adds each acc's standard error. Runs without NIAH meta are left out.
    """
    df = df[df[LENGTH].notna() & df[DEPTH].notna()] if has_needle_grid(df) else df.iloc[:0]
    if df.empty:
        raise ValueError("needle_panels: no records with meta.context_length/meta.depth_percent (no NIAH runs)")
    runs = sort_runs(df.drop_duplicates("run_dir"))["run_dir"].tolist()
    matrices = [needle_matrix(df[df["run_dir"] == r]) for r in runs]
    width = _width(max(m.shape[1] for m in matrices))
    fig = Figure(figsize=(width, 3.2 * len(runs) + 1.2), layout="constrained")
    axes = fig.subplots(len(runs), 1, squeeze=False)[:, 0]
    vmax = _vmax(df["score"].astype(float))
    for i, (ax, run, matrix) in enumerate(zip(axes, runs, matrices)):
        im = _draw(ax, matrix, vmax, xlabel=i == len(runs) - 1)
        letter = string.ascii_lowercase[i] if i < 26 else str(i + 1)
        ax.set_title(f"({letter}) {run_caption(df[df['run_dir'] == run], stderr)}", fontsize=FONT)
    fig.colorbar(im, ax=list(axes)).set_label("Score", fontsize=FONT)
    models = df["model"].unique()
    default = f"{models[0]} - {_context_size(df[LENGTH])} Context Size" if len(models) == 1 else None
    if title or default:
        fig.suptitle(title or default, fontsize=FONT + 4)
    _save(fig, path)
    return fig


def needle_grid(df: pd.DataFrame, methods: list[str], title: str | None = None) -> Figure:
    """The methods' heatmaps side by side, one row per (model, budget), e.g. FullKV / StreamingLLM / H2O / SnapKV /
    PyramidKV at KV 64, 96, 128 (PyramidKV Figs. 9-17 laid out as a grid). The full-cache run has no budget: it
    fills its column in every row. A method without a run at a row's budget leaves its panel empty."""
    df = df[df[LENGTH].notna() & df[DEPTH].notna()] if has_needle_grid(df) else df.iloc[:0]
    if df.empty:
        raise ValueError("needle_grid: no records with meta.context_length/meta.depth_percent (no NIAH runs)")
    rows = [(model, int(b)) for model, g in df.groupby("model", sort=True)
            for b in sorted(g.loc[g["method"] != "full", "budget"].dropna().unique())] \
        or [(model, None) for model in sorted(df["model"].unique())]
    width = _width(max(needle_matrix(g).shape[1] for _, g in df.groupby("run_dir")))
    fig = Figure(figsize=(width * len(methods) / 2, 3.2 * len(rows) + 1.2), layout="constrained")
    axes = fig.subplots(len(rows), len(methods), squeeze=False)
    vmax, im = _vmax(df["score"].astype(float)), None
    for r, (model, budget) in enumerate(rows):
        for c, method in enumerate(methods):
            ax, runs = axes[r, c], df[(df["model"] == model) & (df["method"] == method)]
            if method != "full":
                runs = runs[runs["budget"] == budget]
            run_dirs = runs["run_dir"].unique()
            if len(run_dirs) == 0:
                ax.set_axis_off()
                ax.set_title(f"{method_label(method)}, KV Size={budget}: no run", fontsize=FONT - 2)
                continue
            one = runs[runs["run_dir"] == run_dirs[0]]
            im = _draw(ax, needle_matrix(one), vmax, xlabel=r == len(rows) - 1)
            ax.set_title(run_caption(one), fontsize=FONT - 2)
            ax.set_ylabel(f"{model}\nDepth Percent" if c == 0 else "", fontsize=FONT - 2)
    if im is not None:
        fig.colorbar(im, ax=axes.ravel().tolist()).set_label("Score", fontsize=FONT)
    if title:
        fig.suptitle(title, fontsize=FONT + 4)
    return fig
