"""CLI: `python -m kvbench.report PATH... [--out DIR] [--pdf]`.

Reads every run directory under the given paths and writes table.md, table.tex, table.csv and, when NIAH runs are
present, needle_panels.png (one file per model and dataset when there are several), then prints the Markdown table.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import re
import sys
from pathlib import Path

from kvbench.report.heatmap import LENGTH, has_needle_grid, needle_panels
from kvbench.report.runs import load_runs
from kvbench.report.tables import summary_table, to_markdown, write_tables


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", str(text)).strip("_")


def benchmark_reports(df, out: Path) -> list[Path]:
    """Benchmark-specific layouts: for each dataset family in the runs (`longbench`, `ruler`, ...), a module
    `kvbench.report.<family>` with `write_reports(df, out) -> list[Path]` adds its paper tables and figures.
    The family is the dataset name up to the first underscore (`longbench_e` -> `longbench`)."""
    written: list[Path] = []
    for family in sorted({str(d).split("_")[0] for d in df["dataset"].dropna().unique()}):
        try:
            module = importlib.import_module(f"kvbench.report.{family}")
        except ModuleNotFoundError:
            continue
        written += module.write_reports(df[df["dataset"].astype(str).str.split("_").str[0] == family], out)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbench.report", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="run directories, or folders searched recursively for them")
    parser.add_argument("--out", default="results/report", help="output folder (default: results/report)")
    parser.add_argument("--pdf", action="store_true", help="also write the figures as PDF")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    try:
        df = load_runs(args.paths)
    except (FileNotFoundError, ValueError) as e:
        parser.exit(2, f"{e}\n")
    if df.empty:
        parser.exit(1, "report: the run directories hold no complete prediction records yet\n")
    table = summary_table(df)
    written = write_tables(table, args.out)

    if has_needle_grid(df):
        niah = df[df[LENGTH].notna()]
        groups = list(niah.groupby(["model", "dataset"], sort=True))
        for (model, dataset), g in groups:
            stem = "needle_panels" if len(groups) == 1 else f"needle_panels_{_slug(model)}_{_slug(dataset)}"
            fig = needle_panels(g, written[0].parent / f"{stem}.png")
            written.append(written[0].parent / f"{stem}.png")
            if args.pdf:
                fig.savefig(written[0].parent / f"{stem}.pdf")
                written.append(written[0].parent / f"{stem}.pdf")

    written += benchmark_reports(df, Path(args.out))
    print(to_markdown(table))
    print("wrote: " + ", ".join(str(p) for p in written), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
