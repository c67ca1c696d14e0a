"""The self-contained HTML report, opened in headless Chromium (Debian's package; skipped when it is absent):
tables and figures render, images decode, a header click sorts, and the screenshot shows the heatmap's colours."""
from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from kvbench.report.__main__ import main as report_main
from kvbench.report.paper import load_published
from tests.unit.test_paper_report import longbench_run
from tests.unit.test_report import make_run, niah_records

CHROMIUM = Path("/usr/bin/chromium")


def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """Headless, sandbox and GPU off, no network services, a fresh profile (as CI runs it)."""
    return subprocess.run([str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu",
                           "--disable-background-networking", "--disable-component-update", "--disable-sync",
                           "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}", *args],
                          capture_output=True, text=True)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    """`python -m kvbench.report <runs> --out ... --html page`, by its `main` in this process (the command as a
    process: test_report.py), once for the tests that read the page."""
    tmp_path = tmp_path_factory.mktemp("html")
    root = tmp_path / "results"
    grid = {(n, d): float(d < 50) for n in (1000, 2000) for d in (0.0, 50.0, 100.0)}
    make_run(root, "pyramidkv", 64, niah_records(grid))
    longbench_run(root, "snapkv", 64, {"hotpotqa": [1.0, 0.5], "qasper": [0.25]})
    longbench_run(root, "pyramidkv", 128, {"hotpotqa": [0.5, 0.5], "qasper": [0.75]})
    page = tmp_path / "report.html"
    assert report_main([str(root), "--out", str(tmp_path / "out"), "--html", str(page)]) == 0
    return page


def test_page_is_self_contained(report):
    text = report.read_text()
    assert "http://" not in text and "https://" not in text and "<link" not in text  # no network, no server
    assert text.count("<img alt=") >= 2 and text.count('class="sortable"') >= 2
    assert "data:image/png;base64," in text


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (apt-get install chromium)")
def test_page_renders_in_headless_chromium(report, tmp_path):
    dom = chromium(tmp_path, "--dump-dom", report.as_uri() + "#sortcheck")
    assert dom.returncode == 0, dom.stderr[-2000:]
    body = re.search(r"<body([^>]*)>", dom.stdout).group(1)
    attrs = dict(re.findall(r'data-([a-z-]+)="([^"]*)"', body))
    n_img = report.read_text().count("<img alt=")
    assert attrs["ready"] == "1" and int(attrs["tables"]) >= 2
    assert int(attrs["images-loaded"]) == n_img  # every embedded figure decoded
    sorted_column = json.loads(attrs["sorted-column"].replace("&quot;", '"'))
    numbers = [v for v in sorted_column if isinstance(v, (int, float))]
    assert numbers == sorted(numbers) and len(numbers) >= 2  # the header click sorted the column

    shot = tmp_path / "shot.png"
    res = chromium(tmp_path, f"--screenshot={shot}", "--window-size=1280,2400", "--hide-scrollbars", report.as_uri())
    assert shot.is_file(), res.stderr[-2000:]
    pixels = imread(shot)[..., :3]
    assert (pixels.mean(axis=-1) < 0.9).mean() > 0.02  # text, tables and figures drawn, not a blank page
    green = np.abs(pixels - np.array([0x0C, 0xD7, 0x9F]) / 255).max(axis=-1) < 0.08  # the heatmap's "1.0" colour
    assert green.sum() > 500


def test_paper_page_cites_the_papers(tmp_path):
    """Each table on the page says where its published numbers come from: the paper's citation (issue 35)."""
    root = tmp_path / "results"
    longbench_run(root, "snapkv", 64, {"hotpotqa": [1.0]})
    page = tmp_path / "t11.html"
    assert report_main([str(root), "--paper", "pyramidkv", "--out", str(tmp_path / "out"), "--html", str(page)]) == 0
    text = page.read_text()
    for table in ("t11", "t1"):  # the tables the run fills: Table 11 and Table 1's Llama block
        source = load_published("pyramidkv", table)["source"]
        assert f'<p class="note">Published: {html.escape(source)}</p>' in text
    assert "Table 11 (App. M), p. 23" in text and "arXiv 2406.02069" in text
    assert "shared/" not in text and "specs/" not in text

@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (apt-get install chromium)")
def test_paper_page_renders(tmp_path):
    root = tmp_path / "results"
    longbench_run(root, "snapkv", 64, {"hotpotqa": [1.0]})
    page = tmp_path / "t11.html"
    assert report_main([str(root), "--paper", "pyramidkv", "--out", str(tmp_path / "out"), "--html", str(page)]) == 0
    dom = chromium(tmp_path, "--dump-dom", page.as_uri())
    assert "KV Size = 64" in dom.stdout and "100.00 / 37.34 (+62.66)" in dom.stdout
    attrs = dict(re.findall(r'data-([a-z-]+)="([^"]*)"', re.search(r"<body([^>]*)>", dom.stdout).group(1)))
    # every table the run fills, on one page: Table 11 and Table 1's Llama block (no figure of its own)
    assert attrs["tables"] == "2" and attrs["images-loaded"] == "1"
