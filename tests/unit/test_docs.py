"""The README stays the way in (short, the two commands first) and every link in README.md and docs/ resolves."""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PENDING = {"docs/reproduce.md"}  # issue 23 moves the README's "Reproduce a paper" there; linked ahead of it


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"(?m)^#+ (.+)$", page.read_text(encoding="utf-8"))}


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:: not checked offline
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if dest.relative_to(ROOT).as_posix() in PENDING and not dest.exists():
            continue
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor})")
    return broken


def test_every_link_in_readme_and_docs_resolves():
    problems = {page.relative_to(ROOT).as_posix(): broken_links(page) for page in PAGES}
    assert {k: v for k, v in problems.items() if v} == {}


def test_broken_links_and_anchors_are_found(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "a.md").write_text("# Top\n## Add a method in five steps\n[ok](#top) [ok](b.md#add-a-method-in-five-steps)"
                                   " [web](https://x.org/missing) [gone](c.md) [bad](b.md#nope)\n")
    (tmp_path / "b.md").write_text("## Add a method in five steps\n")
    assert broken_links(tmp_path / "a.md") == ["c.md (no such file)", "b.md#nope (no heading #nope)"]


def test_readme_is_the_way_in():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.encode()) <= 12 * 1024
    assert text.index("make setup demo") < text.index("make setup test") < text.index("## ")  # the two commands first
    assert "python -m kvbench.run" in text
