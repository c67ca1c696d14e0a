"""Text from a hand-edited manifest or an error message, through every table writer: a `|` stays in its cell,
`<script>` stays text, LaTeX's special characters are escaped, a line break does not split a row. Each writer's rows
are counted cell by cell, and the odd cells compared with escapes worked out by hand (kvbench.report.escape's rules).
"""
from __future__ import annotations

import csv
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest

from kvbench.report import load_runs, summary_table, to_latex, to_markdown, write_run_report, write_tables
from kvbench.report import longbench, ruler
from kvbench.report.__main__ import main as report_main
from kvbench.report.cost import cost_lines
from kvbench.report.paper import build_paper_table, to_markdown as paper_markdown
from tests.unit.test_report import record

METHOD = "a|b\n<script>alert(1)</script>"                 # a hand-edited manifest's method
MODEL = r'm&x_1, "50%" #2 $3 {4} \5 ~^'                   # ... and model: every LaTeX special, a comma, quotes
ERROR = "bad | thing\n<b>bold</b> & more"                   # a failed sample's error text
# the same, escaped by hand: Markdown (GFM pipe escape, HTML entities, line break -> space) and LaTeX
METHOD_MD = r"a\|b &lt;script&gt;alert(1)&lt;/script&gt;"
MODEL_MD = r'm&amp;x_1, "50%" #2 $3 {4} \\5 ~^'
METHOD_TEX = r"a\textbar{}b \textless{}script\textgreater{}alert(1)\textless{}/script\textgreater{}"
MODEL_TEX = r'm\&x\_1, "50\%" \#2 \$3 \{4\} \textbackslash{}5 \textasciitilde{}\textasciicircum{}'


def run_dir(root: Path, name: str, records: list[dict], method: str = METHOD, model: str = MODEL,
            dataset: str = "qa", primary: str = "qa_f1", **manifest) -> Path:
    """A run directory as the runner writes it, under a plain folder name (the odd names live in the manifest)."""
    run = root / name
    run.mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"method": method, "budget": 64, "ratio": None, "model": model,
                                                   "dataset": dataset, "dataset_version": "1",
                                                   "primary_metric": primary, **manifest}))
    (run / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


@pytest.fixture
def qa_run(tmp_path: Path) -> Path:
    failed = {"id": "s9", "failed": True, "error_type": "ValueError", "error": ERROR, "where": "decode|step"}
    recs = [record(0, 1.0, prediction="x | <script>y</script>"), record(1, 0.5), failed]
    cost = {"wall_s": 3600.0, "gpu_s": 0.0, "hosts": ["h|<i>"]}
    return run_dir(tmp_path / "results", "run", recs, n_samples=3, cost=cost)


def pipes(line: str) -> int:
    """Cell separators in a Markdown row: `|` after an even number of backslashes (GFM)."""
    return len(re.findall(r"(?<!\\)(?:\\\\)*\|", line))


def md_tables(text: str) -> list[list[str]]:
    """The pipe tables of a Markdown text, each as its lines."""
    tables, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    return tables


def assert_md_shape(text: str) -> None:
    """Every row of every table has its header's number of cells, and no raw HTML is left anywhere."""
    assert md_tables(text)
    for table in md_tables(text):
        assert {pipes(line) for line in table} == {pipes(table[0])}, table
    assert "<" not in text and ">" not in text


def tex_rows(tex: str) -> list[str]:
    """The rows of a tabular: the lines ending in `\\\\`, without the rules."""
    return [line for line in tex.splitlines() if line.endswith(r"\\") and "multicolumn" not in line]


def assert_tex_shape(tex: str, columns: int) -> None:
    """Each row has columns - 1 unescaped `&` and balanced unescaped braces, as `pdflatex` needs."""
    for row in tex_rows(tex):
        assert len(re.findall(r"(?<!\\)&", row)) == columns - 1, row
        assert len(re.findall(r"(?<!\\){", row)) == len(re.findall(r"(?<!\\)}", row)), row


def test_summary_table_markdown_latex_csv(qa_run: Path, tmp_path: Path):
    table = summary_table(load_runs([qa_run]))
    md = to_markdown(table)
    assert_md_shape(md)
    assert md.splitlines()[2].startswith(f"| {MODEL_MD} | qa | {METHOD_MD} | 64 | 2 | 75.00 |")
    tex = to_latex(table)
    assert_tex_shape(tex, 12)  # (Bits and B/entry: issue 45)
    assert tex_rows(tex)[1].startswith(f"{MODEL_TEX} & qa & {METHOD_TEX} & 64 & 2 & 75.00 &")
    with open(write_tables(table, tmp_path / "out")[2], newline="", encoding="utf-8") as f:
        row = next(csv.DictReader(f))  # pandas quotes commas, quotes and line breaks: the text comes back whole
    assert (row["model"], row["method"]) == (MODEL, METHOD)


def test_run_summary_failures_and_cost_lines(qa_run: Path):
    write_run_report(qa_run)
    summary = (qa_run / "summary.md").read_text()
    assert_md_shape(summary)
    error = r"ValueError: bad \| thing &lt;b&gt;bold&lt;/b&gt; &amp; more"
    assert summary.splitlines()[-1] == rf"| s9 | {error} | decode\|step |"
    line, = cost_lines([qa_run])
    assert line == (f"GPU-hours 0.00 | wall-hours 1.00 | qa | {MODEL_MD} | {METHOD_MD} | b64 "
                    r"(3 samples on h\|&lt;i&gt;)")


def longbench_records(scores: dict[str, list[float]]) -> list[dict]:
    return [{"id": f"{task}-{i}", "score": s, "scores": {"longbench": s}, "meta": {"task": task, "index": i,
                                                                                      "length": 0}}
            for task, values in scores.items() for i, s in enumerate(values)]


def test_longbench_and_paper_tables(tmp_path: Path):
    """LongBench's own layout (bold best cells, LaTeX `\\textbf`) and a paper table rebuilt on an odd model name."""
    odd = r"\textbf{b} & c|d<i>"  # once passed to LaTeX raw: it starts like kvbench's own bold markup
    root = tmp_path / "results"
    run_dir(root, "one", longbench_records({"qasper": [1.0], "trec": [0.5]}), method=odd, dataset="longbench",
            primary="longbench")
    run_dir(root, "two", longbench_records({"qasper": [0.0], "trec": [1.0]}), method="snapkv", dataset="longbench",
            primary="longbench")
    df = load_runs([root])
    frame = longbench.table_frame(longbench.run_rows(df))
    md = longbench.to_markdown(frame) + longbench.category_markdown(frame)
    assert_md_shape(md)
    assert r"| 64 | \\textbf{b} &amp; c\|d&lt;i&gt; | **100.00** | 50.00 | **75.00** |" in md.splitlines()
    tex = longbench.to_latex(frame, caption=MODEL)
    assert_tex_shape(tex, 5)
    assert (r"64 & \textbackslash{}textbf\{b\} \& c\textbar{}d\textless{}i\textgreater{} & \textbf{100.00} & 50.00 "
            r"& \textbf{75.00} \\") in tex.splitlines()
    paper = paper_markdown(build_paper_table(df, "pyramidkv", table="t11"))
    assert_md_shape(paper)
    assert f"Rebuilt on {MODEL_MD}, not the paper's" in paper


def test_ruler_table():
    rows = [{"model": MODEL, "dataset": "ruler", "dataset_version": "1", "method": METHOD, "budget": 64,
             "ratio": None, "id": f"vt-{i}", "meta.task": "vt", "meta.length": 4096, "references": ["1"],
             "prediction": "1" if i else "", "score": float(i)} for i in range(2)]
    df = pd.DataFrame(rows).astype({"budget": "Int64", "ratio": "Float64"})
    wide = ruler.wide_table(ruler.task_scores(df))
    md = ruler.to_markdown(wide)
    assert_md_shape(md)
    assert md.splitlines()[2] == f"| {MODEL_MD} | {METHOD_MD} | 64 | 4096 | 50.00 | 50.00 |"
    tex = ruler.to_latex(wide)
    assert_tex_shape(tex, 6)
    assert tex_rows(tex)[1] == rf"{MODEL_TEX} & {METHOD_TEX} & 64 & 4096 & 50.00 & 50.00 \\"


class Tables(HTMLParser):
    """The cells of every <table> of a page, as text (entities decoded), and the <script> elements met."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tables, self.scripts, self.cell = [], 0, None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self.cell = ""
        elif tag == "script":
            self.scripts += 1

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.tables[-1][-1].append(self.cell)
            self.cell = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell += data


def test_html_page_keeps_columns_and_text(qa_run: Path, tmp_path: Path):
    page = tmp_path / "report.html"
    assert report_main([str(qa_run), "--out", str(tmp_path / "out"), "--html", str(page)]) == 0
    parsed = Tables()
    parsed.feed(page.read_text(encoding="utf-8"))
    assert parsed.scripts == 1  # the page's own sorting script; the manifest's is text
    assert parsed.tables and all(len({len(row) for row in table}) == 1 for table in parsed.tables)
    header, first = parsed.tables[0][:2]
    assert dict(zip(header, first))["Model"] == MODEL.replace("\n", " ")
    assert dict(zip(header, first))["Method"] == METHOD.replace("\n", " ")


def test_figures_draw_dollar_signs_as_text(tmp_path: Path):
    """A model or method name with `$...$` that matplotlib cannot parse as math: the run's heatmap and the report's
    panels and length figures are still written (before: ParseFatalException on save)."""
    from tests.unit.test_cli import run_here

    run = run_here("model=tiny_llama", "method=streamingllm", "budget=64", "dataset.context_lengths=[300]",
                   "dataset.depth_percents=[0,100]", "dataset.metrics=[pyramidkv_recall]", "report=false",
                   results=tmp_path / "results")
    manifest = json.loads((run / "manifest.json").read_text())
    manifest.update(model=r"m$\frac{$x", method=r"s$\badcommand{$")
    (run / "manifest.json").write_text(json.dumps(manifest))
    write_run_report(run)
    assert (run / "heatmap.png").stat().st_size > 0
    assert report_main([str(tmp_path / "results"), "--lengths", "--out", str(tmp_path / "report")]) == 0
    assert (tmp_path / "report" / "needle_panels.png").stat().st_size > 0
