"""A seed paper's tables rebuilt from run directories, next to their published numbers.

    python -m kvbench.report results --paper pyramidkv              # every table of the paper that has runs
    python -m kvbench.report results --paper pyramidkv --table t13  # one table (printed with or without runs)

The published numbers ship with the package, one file per table or figure:
`kvbench/report/published/<paper>/<id>.json`, id = the paper's table or figure number in lower case (`t11`,
`t1`, `tb` for BUZZ's Table B, `f7` for a figure); the speed and memory tables, which a benchmark times rather than
a run's records fill, sit apart in `<paper>/speed/<id>.json` (`scripts/bench_paper_speed.py`). Each file holds:

- `paper`, `id`, `title` (the paper), `table` (its caption, as the report's header), `source` (where the numbers
  were transcribed from); `headline: true` on exactly one table per paper: the one `paper=<paper>` and
  `--paper <paper>` without runs stand for;
- `model` (kvbench's model name in the manifests) and `model_config` (configs/model/), `dataset` (the runs'
  dataset name), `cell` (how a cell is rebuilt from records: `{"kind": "longbench_task"}`, `{"kind":
  "metric_mean", "scale": 100}` with each column's `metric`, `{"kind": "geomean", "metrics": [...], "scale": 100}`,
  `{"kind": "record_ppl"}`: exp(total NLL / total tokens) over the records, a perplexity table);
- `columns`: `{key, label}` (+ `metric`, + `match` for columns that are settings, e.g. a budget or a method;
  `mean_of_columns: true` for an average the report recomputes from the row; `cell` to rebuild this column
  another way than the table's, e.g. a memory column `{"kind": "record_max", "field": "kv_bytes"}` or a class
  average `{"kind": "task_mean", "tasks": [...]}`; `dataset` for a column whose runs are on another dataset than
  the table's, e.g. TailorKV Table 3's InfiniteBench classes beside its LongBench ones; `digits` for numbers
  printed with more than 2 decimals);
- `rows`: `{group, label, match, values}` (+ `implemented: false` and `note` for rows kvbench cannot run; `model`
  and `model_config` for tables with a block per model, e.g. PyramidKV Table 1);
  `match` selects the runs: manifest keys `method`, `budget`, `ratio` or any dotted key of the resolved config
  (`positions`, `method.logn`, `dataset.protocol`), and `meta.*` keys the records within them (a latency cell's
  `meta.prompt_length`; a smoke preset's `paper_settings.stand_in` maps a table's value to the one its runs used,
  e.g. TailorKV Table 16's `meta.length` 65536 to 512); `values` maps every column key to the published number (null where the paper prints
  none);
- optional: `runner` (the command that makes the runs of a table no preset runs: Keyformer Table 2's lm-eval),
  `match` at the top (merged into every row's: the settings that set this table's runs apart from the
  paper's other tables on the same dataset), `notes` (lines printed under the table: where the paper's own numbers
  disagree, which reading of the paper ran), `figure` (`budget`, the default: score vs KV size; `needle`: the NIAH
  heatmaps side by side, in the order of `panels` (methods; default FullKV / StreamingLLM / H2O / SnapKV /
  PyramidKV); `none`).

Every cell shows `rebuilt / published (difference)`; a cell without a rebuilt value says why: not run, dataset not
present, model not available, not implemented in kvbench, or not in the run's records. Rebuilt values come from the
records only: LongBench tasks as eval.py scores them (100 x mean, 2 decimals), other metrics as 100 x mean, BUZZ's
"mean ROUGE" as the geometric mean of R-1/R-2/R-L. When the runs hold none of the paper's models (the smoke forms
run the embedded model), that model's values are shown and the header says so; when they hold another of the
paper's models, this table has no runs.
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import yaml
from matplotlib.figure import Figure

from kvbench.report.heatmap import has_needle_grid, needle_grid
from kvbench.report.escape import md_row, md_text, tex_escape
from kvbench.report.settings import SETTING

logger = logging.getLogger(__name__)

PUBLISHED = Path(__file__).resolve().parent / "published"
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TASK = "meta.task"


def paper_names() -> list[str]:
    return sorted(p.name for p in PUBLISHED.iterdir() if p.is_dir() and any(p.glob("*.json")))


def _table_order(table_id: str) -> tuple:
    """t2 < t11 < tb < f7: tables by number (letters after), then figures."""
    kind, rest = table_id[0], table_id[1:]
    return (kind != "t", not rest.isdigit(), int(rest) if rest.isdigit() else 0, rest)


def table_ids(paper: str) -> list[str]:
    """The ids of `paper`'s published tables and figures, in the paper's order; one-line error for an unknown paper."""
    if paper not in paper_names():
        raise ValueError(f"report: unknown paper {paper!r}; choose one of {', '.join(paper_names())}")
    return sorted((p.stem for p in (PUBLISHED / paper).glob("*.json")), key=_table_order)


def headline_id(paper: str) -> str:
    heads = [t for t in table_ids(paper) if json.loads((PUBLISHED / paper / f"{t}.json").read_text("utf-8"))
             .get("headline")]
    if len(heads) != 1:
        raise ValueError(f"report: {paper} needs exactly one headline table, has {heads}")
    return heads[0]


def load_published(paper: str, table: str | None = None) -> dict:
    """One table's spec and published values (the paper's headline table when `table` is None); a one-line error
    naming the valid papers or tables otherwise."""
    ids = table_ids(paper)
    table = headline_id(paper) if table is None else table
    if table not in ids:
        raise ValueError(f"report: unknown table {table!r} for {paper}; choose one of {', '.join(ids)}")
    return json.loads((PUBLISHED / paper / f"{table}.json").read_text(encoding="utf-8"))


def preset_table(preset: str) -> tuple[str, str]:
    """configs/paper/<preset>.yaml -> (paper, table id): `pyramidkv_t13` -> (pyramidkv, t13), and a table's other
    presets `pyramidkv_t15_mistral` -> (pyramidkv, t15); `pyramidkv` and `pyramidkv_smoke` (the paper's shared
    smoke sweep) -> the headline table."""
    stem = preset.removesuffix("_smoke")
    paper, _, rest = stem.partition("_")
    return paper, rest.split("_")[0] or headline_id(paper)


def paper_models(paper: str) -> set[str]:
    """Every model any of the paper's tables names (top level or per row)."""
    models = set()
    for t in table_ids(paper):
        spec = load_published(paper, t)
        models |= {spec["model"], *(r["model"] for r in spec["rows"] if "model" in r)}
    return models


@dataclass
class Cell:
    published: float | None
    rebuilt: float | None = None
    note: str = ""  # why rebuilt is missing

    @property
    def diff(self) -> float | None:
        return None if self.rebuilt is None or self.published is None else self.rebuilt - self.published


@dataclass
class PaperTable:
    spec: dict
    model: str | None  # the model the rebuilt values come from
    rows: list[dict] = field(default_factory=list)  # {"group", "label", "cells": {column key: Cell}}
    other_datasets: list[str] = field(default_factory=list)  # runs found, but none on the paper's dataset
    stand_ins: list[str] = field(default_factory=list)  # smoke runs' values in place of the table's (stand_in)
    records: pd.DataFrame | None = None  # the records on the table's dataset and models (for its figure)

    @property
    def columns(self) -> list[dict]:
        return self.spec["columns"]


# --- which runs belong to a cell ------------------------------------------------------------------------------------
def run_configs(df: pd.DataFrame) -> dict[str, dict]:
    """Each run directory's resolved config.yaml (flattened with dots), read once."""
    out = {}
    for run_dir in df["run_dir"].unique():
        path = Path(run_dir) / "config.yaml"
        cfg = yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else {}
        out[run_dir] = pd.json_normalize(cfg or {}, sep=".").iloc[0].to_dict() if cfg else {}
    return out


def _same(a, b) -> bool:
    if isinstance(b, float) or isinstance(a, float):
        try:
            return math.isclose(float(a), float(b), abs_tol=1e-9)
        except (TypeError, ValueError):
            return False
    return a == b or str(a) == str(b)


def matching_records(df: pd.DataFrame, configs: dict, match: dict) -> pd.DataFrame:
    """Records of the runs whose manifest (method, budget, ratio) and resolved config (any dotted key, e.g.
    `positions`, `method.logn`) equal `match`, and among them those whose record meta equals its `meta.*` keys.
    A full-cache row matches whatever budget its run had."""
    keep = []
    for run_dir, g in df.groupby("run_dir", sort=False):
        row, cfg = g.iloc[0], configs.get(run_dir, {})
        ok = True
        for key, want in match.items():
            if key == "budget" and row["method"] == "full" or key.startswith("meta."):
                continue
            have = row[key] if key in ("method", "budget", "ratio") else cfg.get(key, _defaults.get(key))
            if have is None or (isinstance(have, float) and math.isnan(have)) or not _same(have, want):
                ok = False
                break
        if ok:
            for key in (k for k in match if k.startswith("meta.")):  # record-level: e.g. a latency cell's lengths
                want = stand_in(cfg, key, match[key])
                values = g[key] if key in g else pd.Series(dtype=object)
                g = g.loc[values.index[[_same(have, want) for have in values]]] if len(values) else g.iloc[0:0]
            keep.append(g)
    return pd.concat(keep) if keep else df.iloc[0:0]


def one_setting(records: pd.DataFrame, configs: dict, paper: str, table: str) -> tuple[pd.DataFrame, str]:
    """A cell's records from one run setting (kvbench.report.settings): where runs of different settings match the
    cell, those this table's preset made (`paper_settings` name and id), else the paper's, if they are one setting;
    else none, and why (a cell never averages two settings)."""
    if SETTING not in records or records[SETTING].nunique(dropna=False) < 2:
        return records, ""
    groups = list(records.groupby(SETTING, dropna=False, sort=True))

    def made_by(g: pd.DataFrame, **want: str) -> bool:
        return all(str(configs.get(d, {}).get(f"paper_settings.{k}")) == v for d in g["run_dir"].unique()
                   for k, v in want.items())

    for want in ({"name": paper, "id": table}, {"name": paper}):
        own = [g for _, g in groups if made_by(g, **want)]
        if len(own) == 1:
            return own[0], ""
    labels = "; ".join(s if isinstance(s, str) else "a run of another row" for s, _ in groups)
    return records.iloc[0:0], f"{len(groups)} runs of different settings match ({labels}); report one of their folders"


_defaults = {"positions": "original", "method.logn": False, "method.score": "per_layer"}  # keys older runs lack

STAND_IN = "paper_settings.stand_in."  # a smoke preset's record values that ran in place of the table's


def stand_in(cfg: dict, key: str, want):
    """The record value a run put in place of the table's `want` for `key` (`meta.length`): a smoke preset's
    `paper_settings.stand_in.length: {65536: 512}` (TailorKV Table 16's 64k rows read its 512-token runs); `want`
    itself for every other run."""
    return cfg.get(f"{STAND_IN}{key.removeprefix('meta.')}.{want}", want)


def stand_ins(configs: dict[str, dict]) -> list[str]:
    """`length 65536 ran as 512` for each stand-in value of the runs (the report's header names them)."""
    found = {k.removeprefix(STAND_IN): v for cfg in configs.values() for k, v in cfg.items() if k.startswith(STAND_IN)}
    return [f"{k.rsplit('.', 1)[0]} {k.rsplit('.', 1)[1]} ran as {v}" for k, v in found.items()]


def cell_value(records: pd.DataFrame, spec: dict, column: dict) -> tuple[float | None, str]:
    """The rebuilt value of one cell from its records, or (None, why). `spec` is the table's `cell`, updated by the
    column's own `cell` (a memory column in a table of scores): `record_max` = scale x the largest value of a record
    field (`field`), `record_ratio` = scale x max(field) / max(`per`), `record_sum` = the mean over records of the sum
    of `fields` (timings), `task_mean` = the plain mean of the `tasks`' cells (each as `longbench_task`: a class
    average, TailorKV Table 3), `not_measured` = no value, `note` says why."""
    kind = spec["kind"]
    if kind == "not_measured":
        return None, spec["note"]
    if kind == "record_sum":  # seconds: the mean over records of the sum of timing fields
        missing = [f for f in spec["fields"] if f not in records or records[f].dropna().empty]
        if missing:
            return None, f"{missing[0]} not in the records"
        return float(records[spec["fields"]].astype(float).sum(axis=1).mean()), ""
    if kind in ("record_max", "record_ratio"):  # a record field (kv_bytes ...): its largest value in the run
        col = spec["field"]
        if col not in records or records[col].dropna().empty:
            return None, f"{col} not in the records"
        value = float(records[col].astype(float).max())
        if kind == "record_ratio":
            value /= float(records[spec["per"]].astype(float).max())
        return round(spec.get("scale", 1) * value, 2), ""
    if kind == "record_ppl":  # perplexity over the run's streams: exp(total NLL / total tokens), as scores.json
        if "nll_sum" not in records or records["nll_sum"].dropna().empty:
            return None, "nll_sum not in the records"
        return math.exp(records["nll_sum"].astype(float).sum() / records["n_tokens"].astype(float).sum()), ""
    if kind == "longbench_task":
        rec = records[records[TASK] == column["key"]] if TASK in records else records.iloc[0:0]
        if rec.empty:
            return None, "task not in the run"
        return round(100 * rec["score"].astype(float).mean(), 2), ""
    if kind == "task_mean":  # a class of tasks: the mean of its tasks' cells, as the paper averages its own
        cells = [cell_value(records, {"kind": "longbench_task"}, {"key": task}) for task in spec["tasks"]]
        missing = [task for task, (v, _) in zip(spec["tasks"], cells) if v is None]
        if missing:
            return None, f"task {missing[0]} not in the run"
        return round(sum(v for v, _ in cells) / len(cells), 2), ""
    scale = spec.get("scale", 1)
    metrics = spec["metrics"] if kind == "geomean" else [column["metric"]]
    means = []
    for m in metrics:
        col = f"scores.{m}"
        if col not in records or records[col].dropna().empty:
            return None, f"metric {m} not in the records"
        means.append(scale * records[col].astype(float).mean())
    if kind == "geomean":
        return (math.prod(means) ** (1 / len(means)) if all(v > 0 for v in means) else 0.0), ""
    return means[0], ""


def missing_reason(spec: dict, row: dict, any_runs: bool) -> str:
    """Why a row has no run: not implemented > dataset not present > model not available > not run."""
    if row.get("implemented") is False:
        return row.get("note", "not implemented in kvbench")
    dataset = spec["dataset"]
    if any_runs:  # the table's dataset and a model ran here: this row's run is what is missing
        return "not run"
    config = CONFIGS / "dataset" / f"{dataset}.yaml"
    if not config.is_file():
        return f"dataset not present (no configs/dataset/{dataset}.yaml yet)"
    root = (yaml.safe_load(config.read_text(encoding="utf-8")) or {}).get("root")
    if root and not Path(root).exists():  # downloaded data (LongBench, CNN/DM, XSUM): the config names the script
        return f"dataset not present ({root}: see configs/dataset/{dataset}.yaml)"
    model_config = row.get("model_config", spec["model_config"])
    if not (CONFIGS / "model" / f"{model_config}.yaml").is_file():
        return f"model not available (no configs/model/{model_config}.yaml)"
    return "not run"


def table_datasets(spec: dict) -> set[str]:
    """The datasets the table's runs are on: the table's, and its columns' own (`dataset` on a column)."""
    return {spec["dataset"], *(c["dataset"] for c in spec["columns"] if "dataset" in c)}


def table_models(spec: dict) -> set[str]:
    """The models this table's rows name (`model` per row for multi-model tables like PyramidKV Table 1)."""
    return {spec["model"], *(r["model"] for r in spec["rows"] if "model" in r)}


def choose_model(df: pd.DataFrame, spec: dict, model: str | None) -> str | None:
    """The paper's model when the runs have it (each row then reads its own model's runs); else, when the runs
    hold none of the paper's models, the model with the most records (e.g. a smoke run's); else None: the runs
    belong to the paper's other tables."""
    if model is not None or df.empty:
        return model
    models = df["model"].value_counts()
    if table_models(spec) & set(models.index):
        return spec["model"]
    if paper_models(spec["paper"]) & set(models.index):
        return None
    return str(models.index[0])


def build_paper_table(df: pd.DataFrame, name: str, model: str | None = None, table: str | None = None) -> PaperTable:
    """Published values of `name`'s table `table` (its headline table by default) with the rebuilt ones from `df`
    (load_runs' records) in each cell."""
    spec = load_published(name, table)
    other_datasets: list[str] = []
    if not df.empty and "dataset" in df:
        same = df["dataset"].astype(str).isin(table_datasets(spec))  # longbench_tailorkv: its own tables' dataset
        other_datasets = sorted(df.loc[~same, "dataset"].astype(str).unique()) if not same.any() else []
        df = df[same]
    model = choose_model(df, spec, model)
    own_models = model in table_models(spec)  # else a stand-in model fills every row
    df = df.iloc[0:0] if model is None else df
    configs = run_configs(df) if not df.empty else {}
    table = PaperTable(spec, model if not df.empty else None, other_datasets=other_datasets,
                       records=df[df["model"].isin(table_models(spec) if own_models else {model})],
                       stand_ins=stand_ins(configs))
    for row in spec["rows"]:
        cells = {}
        row_model = row.get("model", spec["model"]) if own_models else model
        row_df = df[df["model"] == row_model] if not df.empty else df
        match = {**spec.get("match", {}), **row.get("match", {})}
        base = matching_records(row_df, configs, match) if "match" in row and not row_df.empty else None
        for col in spec["columns"]:
            cell = Cell(row["values"].get(col["key"]))
            if col.get("mean_of_columns"):
                cells[col["key"]] = cell
                continue
            records = base
            if records is not None and len(table_datasets(spec)) > 1:  # the column's own dataset's runs
                records = records[records["dataset"].astype(str) == col.get("dataset", spec["dataset"])]
            if records is not None and "match" in col:
                records = matching_records(records, configs, col["match"])
            clash = ""
            if records is not None and not records.empty:
                records, clash = one_setting(records, configs, name, spec["id"])
            if records is None or records.empty:
                cell.note = clash or missing_reason(spec, row, not df.empty)
            else:
                cell.rebuilt, cell.note = cell_value(records, {**spec["cell"], **col.get("cell", {})}, col)
            cells[col["key"]] = cell
        for col in spec["columns"]:  # Avg.: the plain mean of the row's other columns, when all are rebuilt
            if col.get("mean_of_columns"):
                parts = [cells[c["key"]] for c in spec["columns"] if not c.get("mean_of_columns")]
                if all(p.rebuilt is not None for p in parts):
                    cells[col["key"]].rebuilt = round(sum(p.rebuilt for p in parts) / len(parts), 2)
                else:
                    missing = [p.note for p in parts if p.rebuilt is None]
                    cells[col["key"]].note = missing[0] if len(set(missing)) == 1 else "needs every column"
        table.rows.append({"group": row.get("group", ""), "label": row["label"], "cells": cells})
    return table


def has_runs(table: PaperTable) -> bool:
    """Whether any cell of the table was rebuilt from a run."""
    return any(cell.rebuilt is not None for row in table.rows for cell in row["cells"].values())


# --- rendering ------------------------------------------------------------------------------------------------------
def _num(v: float | None, digits: int = 2) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def cell_text(cell: Cell, digits: int = 2) -> str:
    """`rebuilt / published (difference)`; a missing rebuilt value gives its reason instead of a difference.
    `digits`: a column's own precision (`digits` in its spec, e.g. 6 for Table 9's allocation seconds)."""
    if cell.rebuilt is None:
        text = f"– / {_num(cell.published, digits)}"
        return f"{text} ({cell.note})" if cell.note else text
    if cell.diff is None:
        return f"{_num(cell.rebuilt, digits)} / –"
    return f"{_num(cell.rebuilt, digits)} / {_num(cell.published, digits)} ({cell.diff:+.{digits}f})"


def header(table: PaperTable) -> list[str]:
    spec = table.spec
    lines = [f"{spec['title']}", f"{spec['table']} — rebuilt / published (difference)", f"Published: {spec['source']}"]
    if table.other_datasets:
        lines.append(f"The runs are on {', '.join(table.other_datasets)}, not the paper's {spec['dataset']}: "
                     "nothing to put in its cells (e.g. a smoke form run before that dataset existed).")
    elif table.model is None:
        lines.append("No matching runs: every rebuilt cell is missing (reasons in the cells).")
    elif table.model != spec["model"]:
        lines.append(f"Rebuilt on {table.model}, not the paper's {spec['model']}: the differences compare models.")
    if table.stand_ins:
        lines.append(f"Stand-ins (a smoke form's paper_settings.stand_in): {'; '.join(table.stand_ins)}.")
    return lines


def to_markdown(table: PaperTable) -> str:
    cols = table.columns
    lines = [f"**{md_text(line)}**" if i == 0 else md_text(line) for i, line in enumerate(header(table))] + [""]
    lines.append(md_row(["", "Method", *(c["label"] for c in cols)]))
    lines.append("|:---|:---|" + "|".join("---:" for _ in cols) + "|")
    for row in table.rows:
        cells = [cell_text(row["cells"][c["key"]], c.get("digits", 2)) for c in cols]
        lines.append(md_row([row["group"], row["label"], *cells]))
    if table.spec.get("notes"):  # where the paper's own numbers disagree; which reading of the paper ran
        lines += [""] + [f"Note: {md_text(note)}" for note in table.spec["notes"]]
    return "\n".join(lines) + "\n"


def to_latex(table: PaperTable) -> str:
    cols = table.columns
    lines = [r"\begin{tabular}{ll" + "r" * len(cols) + "}", r"\toprule",
             " & Method & " + " & ".join(tex_escape(c["label"]) for c in cols) + r" \\", r"\midrule"]
    for row in table.rows:
        cells = [f"{_num(row['cells'][c['key']].rebuilt, c.get('digits', 2))} / "
                 f"{_num(row['cells'][c['key']].published, c.get('digits', 2))}" for c in cols]
        lines.append(" & ".join([tex_escape(row["group"]), tex_escape(row["label"]), *cells]) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(lines) + "\n"


def to_frame(table: PaperTable) -> pd.DataFrame:
    """Long format: one line per cell (row, column, rebuilt, published, difference, note), full precision."""
    return pd.DataFrame([{"paper": table.spec["paper"], "table": table.spec["id"], "group": row["group"],
                          "method": row["label"],
                          "column": c["label"], "rebuilt": cell.rebuilt, "published": cell.published,
                          "difference": cell.diff, "note": cell.note, "rebuilt_model": table.model}
                         for row in table.rows for c in table.columns
                         for cell in [row["cells"][c["key"]]]])


def budget_figure(table: PaperTable) -> Figure | None:
    """Score vs budget per method, published dashed and rebuilt solid: the Avg. column against each row's budget
    (PyramidKV Fig. 3 / Ada-KV style), or, for tables whose columns are budgets (BUZZ), each row across them."""
    spec = table.spec
    series: dict[str, dict[str, list]] = {}
    avg = next((c for c in spec["columns"] if c.get("mean_of_columns")), None)
    for row, raw in zip(table.rows, spec["rows"]):
        budget = raw.get("match", {}).get("budget")
        if avg is not None and budget is not None:
            s = series.setdefault(row["label"], {"x": [], "pub": [], "reb": []})
            cell = row["cells"][avg["key"]]
            s["x"].append(budget), s["pub"].append(cell.published), s["reb"].append(cell.rebuilt)
        elif avg is None and all("match" in c for c in spec["columns"]):
            s = series.setdefault(row["label"], {"x": [], "pub": [], "reb": []})
            for c in spec["columns"]:
                cell = row["cells"][c["key"]]
                s["x"].append(float(c["key"])), s["pub"].append(cell.published), s["reb"].append(cell.rebuilt)
    if not series:
        return None
    fig = Figure(figsize=(7, 4.5), dpi=110)
    ax = fig.add_subplot()
    for i, (label, s) in enumerate(series.items()):
        colour = f"C{i % 10}"
        ax.plot(s["x"], s["pub"], "--o", color=colour, alpha=0.6, label=f"{label} (published)")
        pts = [(x, y) for x, y in zip(s["x"], s["reb"]) if y is not None]
        if pts:
            ax.plot(*zip(*pts), "-s", color=colour, label=f"{label} (rebuilt)")
    budgets = any("budget" in r.get("match", {}) for r in spec["rows"])
    ax.set_xlabel("KV size (entries per head)" if budgets else "cache budget (% of the prompt)")
    if budgets:
        ax.set_xscale("log", base=2)
    ax.set_ylabel(avg["label"] if avg else "score")
    ax.set_title(spec["table"], fontsize=9)
    ax.legend(fontsize=6, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def needle_figure(table: PaperTable) -> Figure | None:
    """The NIAH heatmaps of the table's runs side by side (the spec's `panels`, else NEEDLE_METHODS, FullKV first), one
    row per model and budget: PyramidKV Table 15's figures (Figs. 4, 9-17), Ada-KV's Fig. 6."""
    records = table.records
    if records is None or not has_needle_grid(records):
        return None
    methods = [m for m in table.spec.get("panels", NEEDLE_METHODS) if m in set(records["method"])]
    return needle_grid(records, methods, title=table.spec["table"])


NEEDLE_METHODS = ["full", "streamingllm", "h2o", "snapkv", "pyramidkv"]  # the panels' order, left to right
# a table's `figure` (default "budget") -> its figure builder; "none": tables whose rows are no budget series
FIGURES = {"budget": budget_figure, "needle": needle_figure, "none": lambda table: None}


def write_paper_report(df: pd.DataFrame, name: str, out_dir: str | Path, model: str | None = None,
                       pdf: bool = False, table_id: str | None = None) -> tuple[PaperTable, list[Path]]:
    """Build `name`'s table `table_id` (None: the headline table) and write its files; returns both."""
    table = build_paper_table(df, name, model, table_id)
    return table, write_table_files(table, out_dir, pdf)


def write_table_files(table: PaperTable, out_dir: str | Path, pdf: bool = False) -> list[Path]:
    """paper_<paper>_<id>.md/.tex/.csv (+ paper_<paper>_<id>_<figure>.png) in out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"paper_{table.spec['paper']}_{table.spec['id']}"
    written = [stem.with_suffix(".md"), stem.with_suffix(".tex"), stem.with_suffix(".csv")]
    written[0].write_text(to_markdown(table), encoding="utf-8")
    written[1].write_text(to_latex(table), encoding="utf-8")
    to_frame(table).to_csv(written[2], index=False)
    kind = table.spec.get("figure", "budget")
    fig = FIGURES[kind](table)
    if fig is not None:
        png = out / f"{stem.name}_{kind}.png"
        fig.savefig(png)
        written.append(png)
        if pdf:
            fig.savefig(png.with_suffix(".pdf"))
            written.append(png.with_suffix(".pdf"))
    return written
