"""Config values that become path components (model.name, dataset versions, method labels) must stay plain names.

A run directory is `results_dir/<dataset>/<model.name>/<method>/...` and RULER's cache is
`<cache>/ruler/<version>/<task>/...`: a value such as `../../x` would put files outside the results tree or the cache,
so each such value is checked where it is declared, before anything is written.
"""
from __future__ import annotations

import re
from pathlib import Path

PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=@,-]*")
MAX_NAME = 200


def check_name(what: str, value: object) -> str:
    """Return `value` if it is one plain path component (letters, digits, `_.+=@,-`, not starting with a dot,
    no separators, no `..`); else raise a one-line ValueError naming `what` (e.g. "model: name")."""
    text = str(value)
    if not PLAIN_NAME.fullmatch(text) or ".." in text or len(text) > MAX_NAME:
        raise ValueError(f"{what}={text!r} becomes a folder name, so it must be a plain name (letters, digits and "
                         f"_ . + = @ , - ; no '/', no '..', not starting with a dot)")
    return text


def check_inside(path: Path, root: Path, what: str) -> Path:
    """Raise a one-line ValueError unless `path` lies inside `root` once both are resolved (defence in depth)."""
    resolved, base = Path(path).resolve(), Path(root).resolve()
    if resolved != base and base not in resolved.parents:
        raise ValueError(f"{what}: {path} would be written outside {root}")
    return path
