"""One self-contained HTML page with every table and figure a report wrote: no server, no network.

    python -m kvbench.report results --html report.html            (every table and figure of the tree)
    python -m kvbench.report results --paper pyramidkv --html t11.html

Markdown tables (`*.md`, the layouts people read) become HTML tables sortable by a click on a column header
(numeric when the cells start with a number); PNG figures are embedded as base64 data URIs. A small inline
script sorts and, once the page has loaded, records on <body> how many tables and decoded images it holds
(`data-tables`, `data-images-loaded`); opened as `report.html#sortcheck` it also sorts the first table by its last
column and records the resulting order (`data-sorted-column`). The headless-browser test reads these.
"""
from __future__ import annotations

import base64
import html
import re
from pathlib import Path

from kvbench.report.escape import md_split_row, md_unescape

STYLE = """body{font-family:system-ui,sans-serif;margin:24px;color:#222}h1{font-size:20px}h2{font-size:16px;
margin-top:28px;border-bottom:1px solid #ccc}table{border-collapse:collapse;font-size:12px;margin:8px 0}
th,td{border:1px solid #ccc;padding:3px 6px;text-align:right;white-space:nowrap}th{background:#eef;cursor:pointer}
td:first-child,th:first-child,td:nth-child(2){text-align:left}img{max-width:100%;border:1px solid #ddd}
p.note{color:#555;font-size:12px;margin:2px 0}"""

SCRIPT = """
function cellKey(td){var t=td.textContent.trim();var m=t.match(/^[-+]?\\d+(\\.\\d+)?/);return m?parseFloat(m[0]):t;}
function sortBy(th){var table=th.closest('table'),i=Array.prototype.indexOf.call(th.parentNode.children,th);
 var body=table.tBodies[0],rows=Array.prototype.slice.call(body.rows),asc=th.dataset.dir!=='asc';
 rows.sort(function(a,b){var x=cellKey(a.cells[i]),y=cellKey(b.cells[i]);
  if(typeof x===typeof y){return (x<y?-1:x>y?1:0)*(asc?1:-1);}return (typeof x==='number'?-1:1)*(asc?1:-1);});
 rows.forEach(function(r){body.appendChild(r);});th.dataset.dir=asc?'asc':'desc';}
document.querySelectorAll('table.sortable th').forEach(function(th){th.addEventListener('click',function(){sortBy(th);});});
window.addEventListener('load',function(){var imgs=document.images,ok=0;
 for(var k=0;k<imgs.length;k++){if(imgs[k].complete&&imgs[k].naturalWidth>0){ok++;}}
 document.body.dataset.imagesLoaded=ok;document.body.dataset.tables=document.querySelectorAll('table.sortable').length;
 if(location.hash==='#sortcheck'){var th=document.querySelector('table.sortable th:last-child');sortBy(th);
  var v=Array.prototype.map.call(th.closest('table').tBodies[0].rows,function(r){return cellKey(r.cells[r.cells.length-1]);});
  document.body.dataset.sortedColumn=JSON.stringify(v);}
 document.body.dataset.ready='1';});
"""


BOLD = re.compile(r"^\*\*(.*)\*\*(\S?)$")  # a best score in bold, then its mark, if any


def cell_html(cell: str) -> str:
    """One escaped Markdown cell (kvbench.report.escape) as HTML text: the bold kvbench puts on a best score
    (`**12.30**`, a mark after it) dropped, the text unescaped, then escaped for HTML."""
    return html.escape(md_unescape(BOLD.sub(r"\1\2", cell)))


def markdown_blocks(text: str) -> list[str]:
    """Markdown (pipe tables and plain lines, as kvbench's reports write it) -> HTML fragments. Rows are split at
    unescaped pipes only, so every row keeps its header's number of cells."""
    out, table = [], []

    def flush():
        if table:
            rows = [md_split_row(line) for line in table]
            head, body = rows[0], [r for r in rows[2:]]
            out.append('<table class="sortable"><thead><tr>' + "".join(f"<th>{cell_html(c)}</th>" for c in head)
                       + "</tr></thead><tbody>" + "".join(
                           "<tr>" + "".join(f"<td>{cell_html(c)}</td>" for c in r) + "</tr>"
                           for r in body) + "</tbody></table>")
            table.clear()

    for line in text.splitlines():
        if line.strip().startswith("|"):
            table.append(line)
            continue
        flush()
        if line.strip():
            out.append(f'<p class="note">{html.escape(md_unescape(line.strip().strip("*#").strip()))}</p>')
    flush()
    return out


def write_html(path: str | Path, files: list[Path], title: str = "kvbench report",
               headings: dict[Path, str] | None = None) -> Path:
    """Write the page: one section per Markdown table file and per PNG figure among `files`, in their order, each
    headed by `headings[file]` (a paper's "Table 11", its figure) or else the file's name."""
    headings = {Path(k): v for k, v in (headings or {}).items()}
    sections = []
    for f in map(Path, files):
        heading = html.escape(headings.get(f, f.name))
        if f.suffix == ".md" and f.is_file():
            sections.append(f"<h2>{heading}</h2>" + "".join(markdown_blocks(f.read_text("utf-8"))))
        elif f.suffix == ".png" and f.is_file():
            data = base64.b64encode(f.read_bytes()).decode("ascii")
            sections.append(f'<h2>{heading}</h2><img alt="{heading}" src="data:image/png;base64,{data}">')
    page = (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>{''.join(sections)}"
            f"<script>{SCRIPT}</script></body></html>\n")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path
