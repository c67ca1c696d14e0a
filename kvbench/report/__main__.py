"""CLI: `python -m kvbench.report PATH... [--out D] [--pdf] [--stderr] [--compare M] [--paper P [--table T]] [--html F]`

Reads every run directory under the given paths and writes table.md, table.tex, table.csv and, when NIAH runs are
present, needle_panels.png (one file per model and dataset when there are several), then prints the Markdown table.
`--stderr` shows every score as "mean ± standard error"; `--compare full` adds each cell's paired-bootstrap
difference to the full cache (or any method) with its 95 % interval and marks those that exclude 0.
`--lengths` adds lengths.md (accuracy, length and its inflation over the full cache, KV held while decoding, time;
always written for the long-generation datasets). `--paper pyramidkv` (adakv, tailorkv, keyformer, buzz) prints
every table of that paper that has runs instead (its headline table when none has), rebuilt next to the published
numbers (kvbench.report.paper); `--table t13` picks one; `--html report.html` also writes one self-contained page
with every table and figure written.
Files go to `--out`, by default `report/` in the deepest folder holding every PATH (`results` -> results/report), and
the last line printed says how many went where. Bad or damaged input ends with one line `kvbench: ...`, exit code 1.

A command, so it sits on the top floor with runs/ (docs/ARCHITECTURE.md, "Floors"): it merges stale sharded runs
through kvbench.runs.merge before reading; the rest of report/ reads run directories and never imports runs/.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import logging
import os
import signal
import sys
from pathlib import Path

INTERRUPTED = "kvbench: report: interrupted; every record is kept, rerun the same command for the whole report"


def _interrupted_while_starting(signum, frame) -> None:
    """Ctrl-C during the imports below, before `main` can catch it: one line, no traceback, nothing written yet."""
    print(INTERRUPTED, file=sys.stderr)
    os._exit(130)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, _interrupted_while_starting)

from kvbench.metrics.stats import RESAMPLES, SEED
from kvbench.runs.merge import merge_stale
from kvbench.report.compare import Compare, resolve_reference
from kvbench.report.cost import cost_lines
from kvbench.report.escape import plain_figure_text, slug
from kvbench.report.heatmap import LENGTH, has_needle_grid, needle_panels
from kvbench.report.html import write_html
from kvbench.report.lengths import LONG_GENERATION
from kvbench.report.lengths import write_reports as length_reports
from kvbench.report.paper import build_paper_table, has_runs, headline_id, paper_names, table_ids, write_table_files
from kvbench.report.paper import to_markdown as paper_markdown
from kvbench.report.runs import ManifestError, load_runs
from kvbench.report.settings import folder_name, setting_parts
from kvbench.report.tables import summary_table, to_markdown, write_tables


# dataset families whose tables live in one shared module (cnn_dailymail -> "cnn", lost_in_the_middle -> "lost")
SEED_FAMILIES = {"cnn": "seed_tasks", "xsum": "seed_tasks", "lost": "seed_tasks", "wikitext": "seed_tasks",
                 "infinitebench": "seed_tasks"}
# datasets that are a family of their own whatever their first word (longbench_v2 is not LongBench v1)
WHOLE_NAMES = {"longbench_v2": "long_context", "zero_scrolls": "long_context", "loogle": "long_context"}


def family(dataset: str) -> str:
    """The dataset's family: its own entry in WHOLE_NAMES, else its name up to the first underscore."""
    return WHOLE_NAMES.get(dataset, dataset.split("_")[0])


def benchmark_reports(df, out: Path, **options) -> list[Path]:
    """Benchmark-specific layouts: for each dataset family in the runs (`longbench`, `ruler`, ...), a module
    `kvbench.report.<family>` with `write_reports(df, out) -> list[Path]` adds its paper tables and figures.
    The family is the dataset name up to the first underscore (`longbench_e` -> `longbench`), or WHOLE_NAMES'."""
    written: list[Path] = []
    families = df["dataset"].astype(str).map(family)
    for name in sorted(set(families[df["dataset"].notna()])):
        try:
            module = importlib.import_module(f"kvbench.report.{SEED_FAMILIES.get(name, name)}")
        except ModuleNotFoundError:
            continue
        accepted = inspect.signature(module.write_reports).parameters  # families without stderr/compare still work
        written += module.write_reports(df[families == name], out,
                                        **{k: v for k, v in options.items() if k in accepted})
    return written


class InputError(ValueError):
    """The paths hold nothing to report on, or no folder to write the report to."""


def default_out(paths: list[str]) -> Path:
    """`report/` in the deepest folder holding every path (a folder holds itself): `results` -> results/report,
    `results/niah/a results/niah/b` -> results/niah/report; so a report lands beside its runs, whatever the current
    directory, and `python -m kvbench.report results` writes where `--out results/report` always did."""
    common = Path(os.path.commonpath([os.path.abspath(p) for p in paths]))
    if common == Path(common.anchor):
        raise InputError(f"report: {' '.join(paths)} share no folder below {common}; pass --out to say where the "
                         "report goes")
    return common / "report"


def wrote_line(written: list[Path], out: str | Path) -> str:
    """The last line a report prints: how many files it wrote into which folder (absolute), and any it wrote
    elsewhere (an `--html` page outside it)."""
    out = Path(os.path.abspath(out))
    files = [Path(os.path.abspath(p)) for p in dict.fromkeys(written)]
    inside = [p for p in files if p.is_relative_to(out)]
    elsewhere = [str(p) for p in files if not p.is_relative_to(out)]
    return f"report: wrote {len(inside)} files to {out}" + (f" and {', '.join(elsewhere)}" if elsewhere else "")


def main(argv: list[str] | None = None) -> int:
    """The command; Ctrl-C anywhere in it is one line (INTERRUPTED) and exit code 130, as a shell expects."""
    if signal.getsignal(signal.SIGINT) is _interrupted_while_starting:  # started as a command: Ctrl-C raises again
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return report(argv)
    except KeyboardInterrupt:
        sys.stdout.flush()
        print(INTERRUPTED, file=sys.stderr)
        return 130


def report(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbench.report", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="run directories, or folders searched recursively for them")
    parser.add_argument("--out", help="output folder (default: report/ in the deepest folder holding every PATH: "
                                      "results -> results/report, results/niah/a results/niah/b -> "
                                      "results/niah/report)")
    parser.add_argument("--pdf", action="store_true", help="also write the figures as PDF")
    parser.add_argument("--stderr", action="store_true", help='show scores as "mean ± standard error"')
    parser.add_argument("--compare", metavar="METHOD", help="paired bootstrap of each cell against this method "
                        "(registry name or table label, e.g. full), or against the same method in a query mode "
                        "(aware, agnostic)")
    parser.add_argument("--resamples", type=int, default=RESAMPLES, help=f"bootstrap resamples (default {RESAMPLES})")
    parser.add_argument("--seed", type=int, default=SEED, help=f"bootstrap seed (default {SEED})")
    parser.add_argument("--paper", help=f"a paper's tables next to its published numbers (those with runs): "
                                        f"{', '.join(paper_names())}")
    parser.add_argument("--table", help="with --paper: only this table or figure (t11, tb, f7, ...), runs or not")
    parser.add_argument("--model", help="with --paper: the model whose runs fill the table (default: the paper's "
                                        "model if present, else the model with the most records)")
    parser.add_argument("--html", help="also write one self-contained HTML page with every table and figure")
    parser.add_argument("--lengths", action="store_true", help="lengths.md for every run: accuracy, mean length, "
                        f"inflation over the full cache, KV held while decoding, end-to-end time (always for "
                        f"{', '.join(LONG_GENERATION)})")
    args = parser.parse_args(argv)
    if args.resamples < 100:
        parser.exit(2, f"kvbench: --resamples={args.resamples} is too few for a 95 % interval; use at least 100\n")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.paper is not None and args.paper not in paper_names():
        parser.exit(2, f"kvbench: unknown paper {args.paper!r}; choose one of {', '.join(paper_names())}\n")
    if args.table is not None and (args.paper is None or args.table not in table_ids(args.paper)):
        valid = f"{args.paper} has {', '.join(table_ids(args.paper))}" if args.paper else "it needs --paper"
        parser.exit(2, f"kvbench: unknown table {args.table!r}; {valid}\n")

    try:  # bad or damaged input (ValueError), or a folder it cannot read or write: one line, no traceback
        df = read_input(args)
        with plain_figure_text():  # names with `$` are text, not math, in every figure
            return paper_main(df, args) if args.paper is not None else report_main(df, args, parser)
    except (InputError, ManifestError, OSError) as e:
        print(f"kvbench: {' '.join(str(e).splitlines()).removeprefix('kvbench: ')}", file=sys.stderr)
        return 1


def read_input(args):
    """The records of every run under args.paths, with args.out set (default_out). Unreadable input raises an
    InputError, except that `--paper` gets None when the paths hold no runs (its cells then say why); a damaged
    manifest.json always raises (runs.ManifestError)."""
    if args.out is None:
        args.out = str(default_out(args.paths))
    try:
        merge_stale(args.paths)  # sharded runs whose shards changed since their last merge
    except ValueError as e:  # e.g. a shard's manifest that is not JSON
        raise InputError(f"report: merging the sharded runs under {' '.join(args.paths)} failed: {e}") from None
    try:
        df = load_runs(args.paths)
    except ManifestError:
        raise
    except (FileNotFoundError, ValueError) as e:
        if args.paper is None:
            raise InputError(str(e)) from None
        logging.getLogger("kvbench.report").warning("%s; every cell will say why it is missing", e)
        return None
    if df.empty and args.paper is None:
        raise InputError("report: the run directories hold no complete prediction records yet")
    return df


def report_main(df, args, parser) -> int:
    """The summary table, the NIAH panels, each benchmark's layouts, the cost lines and the `--html` page."""
    compare = None
    if args.compare:
        try:
            axis, reference = resolve_reference(args.compare, df["method"].dropna().unique(), df["query"].unique())
            compare = Compare(reference, args.resamples, args.seed, axis=axis)
        except ValueError as e:
            parser.exit(2, f"{e}\n")
    table = summary_table(df, compare)
    written = write_tables(table, args.out, stderr=args.stderr)

    if has_needle_grid(df):
        niah = df[df[LENGTH].notna()]
        groups = list(niah.groupby(["model", "dataset", "query"], sort=True))
        for (model, dataset, query), g in groups:
            stem = "needle_panels" if len(groups) == 1 else f"needle_panels_{slug(model)}_{slug(dataset)}"
            stem += "" if query == "aware" else f"_{query}"
            fig = needle_panels(g, written[0].parent / f"{stem}.png", stderr=args.stderr)
            written.append(written[0].parent / f"{stem}.png")
            if args.pdf:
                fig.savefig(written[0].parent / f"{stem}.pdf")
                written.append(written[0].parent / f"{stem}.pdf")

    # a fresh Compare per family, so each table's note lists only its own unpaired samples
    options = {"stderr": args.stderr, "compare": Compare(compare.reference, args.resamples, args.seed)
               if compare and compare.axis == "method" else None}
    for setting, runs in setting_parts(df):  # runs of one row key whose settings differ: each in its own folder
        out = Path(args.out) / ("" if setting is None else folder_name(setting))
        if setting is not None:
            print(f"report: the runs with {setting} (another run shares their method and size): their benchmark "
                  f"layouts are in {out}", file=sys.stderr)
        for query, part in runs.groupby("query", sort=True):  # per query mode (agnostic: a subfolder)
            written += benchmark_reports(part, out / ("" if query == "aware" else f"query-{query}"), **options)
        long = runs if args.lengths else runs[runs["dataset"].isin(LONG_GENERATION)]
        if not long.empty:  # what compression did to the answers' length, memory and time
            written += length_reports(long, out)
    if args.html:
        written.append(write_html(args.html, written, title=f"kvbench report: {', '.join(args.paths)}"))
    print(to_markdown(table, stderr=args.stderr))
    costs = cost_lines(df["run_dir"].unique())
    if costs:  # what each configuration cost, from the manifests (sums over shards and resumes)
        (Path(args.out) / "cost.md").write_text("\n".join(costs) + "\n", encoding="utf-8")
        written.append(Path(args.out) / "cost.md")
        print("\n".join(costs))
    sys.stdout.flush()
    print(wrote_line(written, args.out), file=sys.stderr)
    return 0


def paper_main(df, args) -> int:
    """`--paper`: the paper's layouts (Markdown printed; LaTeX, CSV and each table's figure written): every table
    with runs, or `--table`'s, or the headline table when no table has runs (its cells say why)."""
    import pandas as pd

    if df is None or df.empty:
        df = pd.DataFrame(columns=["model", "dataset", "method", "budget", "ratio", "run_dir", "id", "score"])
    ids = [args.table] if args.table else table_ids(args.paper)
    tables = {t: build_paper_table(df, args.paper, args.model, t) for t in ids}
    shown = [t for t in tables if args.table or has_runs(tables[t])] or [headline_id(args.paper)]
    written, headings = [], {}
    for t in shown:
        files = write_table_files(tables[t], args.out, args.pdf)
        name = tables[t].spec["table"].split(":")[0]  # "Table 11 (App. M)": the page's heading for its files
        headings.update({f: name if f.suffix == ".md" else f"{name}, figure" for f in files})
        written += files
        print(paper_markdown(tables[t]))
    if not args.table and len(shown) < len(tables):
        print(f"No runs here for {', '.join(t for t in tables if t not in shown)} of {args.paper}: "
              f"--table <id> shows one with the reason in each cell.")
    if args.html:
        title = f"kvbench: {args.paper} " + ", ".join(tables[t].spec["table"].split(":")[0] for t in shown)
        written.append(write_html(args.html, written, title=title, headings=headings))
    sys.stdout.flush()
    print(wrote_line(written, args.out), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
