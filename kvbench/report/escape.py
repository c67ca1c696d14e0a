"""Text from records and manifests into table cells, one escape per format, so that whatever a hand-edited manifest
or an error message holds (`a|b`, `<script>`, `50%_x`, a line break) stays inside its cell and reads as written.

Markdown (GitHub-flavoured pipe tables; `md_cell`): `\\` and `|` get a backslash, so a cell can neither end early nor
eat the escape of the next separator; `&`, `<`, `>` become `&amp;`, `&lt;`, `&gt;`, so a renderer never sees raw HTML
or an entity the text did not mean; a line break becomes a space (a row is one line). Other inline syntax (`*`, `_`,
backticks, links) is left as written: it can change how a cell looks, never the table's shape or what runs. Markup
kvbench adds itself (`**best**`) goes around the escaped text. `md_text` is the same for a line outside a table (a
heading, a note) minus the pipe; `md_split_row` and `md_unescape` undo both for kvbench.report.html.
LaTeX (`tex_escape`): the ten special characters, `<`, `>`, `|` (other glyphs in OT1 fonts), ± Δ † as math, line
breaks as spaces. HTML: `html.escape` of the unescaped text (kvbench.report.html). CSV: pandas quotes a field holding
a comma, a quote or a line break (RFC 4180), so nothing is done here.
"""
from __future__ import annotations

import re

# every character str.splitlines() breaks at: html.py reads Markdown back line by line
_BREAKS = re.compile("[\r\n\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]+")
_ENTITIES = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}
_UNESCAPE = re.compile(r"\\([\\|])|&(amp|lt|gt);")


def md_text(text: object) -> str:
    """A line of Markdown prose: `\\`, `&`, `<`, `>` escaped, line breaks as spaces."""
    text = _BREAKS.sub(" ", str(text)).replace("\\", "\\\\")
    return "".join(_ENTITIES.get(ch, ch) for ch in text)


def md_cell(text: object) -> str:
    """A Markdown table cell: `md_text` plus `|` -> `\\|`."""
    return md_text(text).replace("|", r"\|")


def md_row(cells: list) -> str:
    """`| a | b |` with every cell escaped (`md_cell`); an empty cell is `| |`."""
    return "|" + "|".join(f" {text} " if text else " " for text in map(md_cell, cells)) + "|"


def md_unescape(text: str) -> str:
    """The text `md_cell` or `md_text` escaped (an exact inverse: one left-to-right pass)."""
    return _UNESCAPE.sub(lambda m: m.group(1) or {"amp": "&", "lt": "<", "gt": ">"}[m.group(2)], text)


def md_split_row(line: str) -> list[str]:
    """The cells of a pipe-table row, still escaped: split at each `|` not escaped by a backslash (a backslash escapes
    the next character, as in GFM), the outer pipes dropped, each cell stripped."""
    line = line.strip()
    cells, cell, chars, closed = [], [], iter(line), False
    for ch in chars:
        closed = ch == "|"
        if ch == "\\":
            cell.append(ch + next(chars, ""))
        elif ch == "|":
            cells.append("".join(cell).strip())
            cell = []
        else:
            cell.append(ch)
    if not closed:
        cells.append("".join(cell).strip())
    return cells[1:] if line.startswith("|") else cells


_TEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{", "}": r"\}",
        "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "<": r"\textless{}", ">": r"\textgreater{}",
        "|": r"\textbar{}", "±": r"$\pm$", "Δ": r"$\Delta$", "†": r"$^\dagger$"}


def tex_escape(text: object) -> str:
    """Text for a LaTeX cell, caption or note (text mode): method and dataset names often contain `_`."""
    return "".join(_TEX.get(ch, ch) for ch in _BREAKS.sub(" ", str(text)))


def slug(text: object) -> str:
    """A file-name-safe form of a model or dataset name (`org/model v2` -> `org_model_v2`)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", str(text)).strip("_")


def plain_figure_text():
    """A context in which figure text is drawn as written: matplotlib reads `$...$` in a title or legend as math,
    so a method or model name holding two `$` would change shape, or fail the save ("ParseFatalException").
    Every figure of the report is drawn inside it (no label of kvbench's own uses math)."""
    import matplotlib

    return matplotlib.rc_context({"text.parse_math": False})
