"""A config value's rule and the check that runs before the heavy imports (torch, transformers: 4-60 s).

`Rule` and `Range` are what kvbench/runs/schema.py builds from each config class's field annotations and its
`RANGES` table. Building them needs the classes, and importing those imports torch; so schema.py also writes every
built-in class's rules to rules.json (`python -m kvbench.runs.schema`; tests/unit/test_schema.py fails when it is
out of date), and `check_early(cfg)` judges a composed config from that file alone: a bad value is refused as fast as
a misspelt name (issue 42). A class whose source files changed since rules.json was written, or that is not in it (a
user's own method), is left to schema.check, which `setup` runs anyway; so the early check can only refuse what
the late one refuses, with the same line.
"""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

SNAPSHOT = Path(__file__).with_name("rules.json")
PACKAGE = Path(__file__).resolve().parents[1]  # kvbench/: the snapshot's source paths are relative to it
KINDS = {"int": int, "float": float, "bool": bool, "str": str}
NODE_CLASSES = {"generation": "kvbench.engine.generation.Sampling", "model": "kvbench.models.loader.ModelSpec",
                "decode_compression": "kvbench.engine.recompress.DecodeCompression"}  # schema.NODES, by name
RUN_CLASS = "kvbench.runs.schema.Run"
REMOTE_CLASS = "kvbench.remote.spec.RemoteSpec"  # a model node with `base_url` (model=openai)


@dataclass(frozen=True)
class Range:
    """What a value may be beyond its type: bounds or choices; or who else judges it; or anything (free text)."""

    low: float | None = None
    high: float | None = None
    open_low: bool = False  # low itself is out
    open_high: bool = False
    choices: tuple = ()
    note: str = ""  # what the value means, for the message
    says: str = ""  # the whole "must be ..." phrase, where the generated one would read badly
    owner: str = ""  # who judges it instead, in one line (its class's __post_init__, check_budget, Shard.parse)
    free: bool = False  # free text: a path, a name, a template; the type is the whole rule
    default_only: bool = False  # names what the class itself writes (the score it reports): its default only

    def allows(self, value) -> bool:
        if self.choices:
            return value in self.choices
        if self.low is not None and not (value > self.low if self.open_low else value >= self.low):
            return False
        return self.high is None or (value < self.high if self.open_high else value <= self.high)

    def bounds(self) -> str:
        """' >= 1', ' in (0, 1]', '' (unbounded)."""
        if self.low is not None and self.high is not None:
            return f" in {'(' if self.open_low else '['}{self.low:g}, {self.high:g}{')' if self.open_high else ']'}"
        if self.low is not None:
            return f" {'>' if self.open_low else '>='} {self.low:g}"
        return f" {'<' if self.open_high else '<='} {self.high:g}" if self.high is not None else ""


@dataclass(frozen=True)
class Rule:
    """A field's annotation (type, None allowed, a list of such values) and its range."""

    kind: type | None  # int, float, bool or str; None: no type (a mapping, a list's untyped items, Any)
    null: bool
    many: bool
    range: Range

    def problem(self, value) -> str | None:
        """What is wrong with `value` ("must be ...", "is not one of ..."), or None."""
        if value is None:
            return None if self.null else f"must be {self.phrase()}"
        if self.many and not isinstance(value, (list, tuple)):
            return f"must be {self.phrase()}"
        for item in value if self.many else [value]:
            if not fits(item, self.kind):
                return self.choices_text() if self.range.choices else f"must be {self.phrase()}"
            if not self.range.owner and not self.range.allows(item):
                return self.choices_text() if self.range.choices else f"must be {self.phrase(typed=True)}"
        return None

    def choices_text(self) -> str:
        note = f" ({self.range.note})" if self.range.note else ""
        return "is not one of " + ", ".join(map(str, self.range.choices)) + (", null" if self.null else "") + note

    def phrase(self, typed: bool = False) -> str:
        """'a positive integer', 'an integer >= 0', 'in [0, 1)' (a number of the right type out of its range)."""
        r = self.range
        if r.says:
            return r.says
        if r.choices:
            text = "one of " + ", ".join(map(str, r.choices))
        elif self.kind is int:
            positive = (r.low, r.high, r.open_low) == (1, None, False)
            text = "a positive integer" if positive else "an integer" + r.bounds()
        elif self.kind is float:
            text = r.bounds().strip() if typed and r.bounds() else "a number" + r.bounds()
        else:
            text = {bool: "true or false", str: "a string"}.get(self.kind, "a value")
        if self.many:
            text = f"a list, each item {text}"
        if self.null:
            text += ", or null"
        return text + (f" ({r.note})" if r.note else "")


def fits(value, kind: type | None) -> bool:
    """Of the type: an int is a number, a bool is neither an int nor a number."""
    if kind is None:
        return True
    if isinstance(value, bool):
        return kind is bool
    return isinstance(value, (int, float)) if kind is float else isinstance(value, kind)


def problem_line(key: str, value, rule: Rule, who: str = "") -> str | None:
    """The one-line refusal of `value` for `key` (`snapkv: method.window=0 must be a positive integer`), or None."""
    problem = rule.problem(value)
    if problem is None:
        return None
    hint = ""
    if rule.kind is str and not rule.range.choices and isinstance(value, (int, float)):
        hint = f"; quote it to pass text: {key}=\"'{value}'\""
    return f"{who + ': ' if who else ''}{key}={value!r} {problem}{hint}"


# --- rules.json: the rules of every built-in config class, readable without importing it ----------------------
def rule_json(rule: Rule | None) -> dict | None:
    if rule is None:
        return None
    kind = next((name for name, k in KINDS.items() if k is rule.kind), None)
    return {"kind": kind, "null": rule.null, "many": rule.many, "range": asdict(rule.range)}


def rule_from_json(data: dict | None) -> Rule | None:
    if data is None:
        return None
    found = dict(data["range"], choices=tuple(data["range"]["choices"]))
    return Rule(KINDS.get(data["kind"]), data["null"], data["many"], Range(**found))


def source_hash(relative: str) -> str | None:
    """sha256 (16 hex digits) of a file under kvbench/, or None where it is gone."""
    path = PACKAGE / relative
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.is_file() else None


@functools.cache
def snapshot() -> dict:
    try:
        return json.loads(SNAPSHOT.read_text())
    except (OSError, ValueError):  # missing or damaged: everything is left to the late check
        return {"classes": {}}


@functools.cache
def current(target: str) -> dict | None:
    """A class's entry of rules.json, if its source files are those it was written from."""
    entry = snapshot()["classes"].get(target)
    if entry is None or any(source_hash(path) != digest for path, digest in entry["sources"].items()):
        return None
    return entry


def plain(node) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, (DictConfig, ListConfig)) else node


def check_early(cfg: DictConfig) -> None:
    """Raise ValueError with schema.check's line for the first value of a composed config that breaks its rule in
    rules.json; then the budget rule of the method's `check_budget` (a positive integer unless ratio is set), where
    the method runs with its defaults. Anything rules.json cannot say is left to `setup`."""
    run = current(RUN_CLASS)
    for key in cfg:
        if key == "hydra":
            continue
        node = cfg[key]
        if not isinstance(node, DictConfig) or (key not in NODE_CLASSES and key not in ("method", "dataset")):
            rule = rule_from_json(run["rules"].get(key)) if run is not None else None
            line = problem_line(key, plain(node), rule) if rule is not None else None
            if line is not None:
                raise ValueError(line)
            continue
        target = REMOTE_CLASS if key == "model" and "base_url" in node else NODE_CLASSES.get(key)
        entry = current(target or str(node.get("_target_", "")))
        if entry is None:
            continue
        for name, value in plain(node).items():
            rule = rule_from_json(entry["rules"].get(name)) if name != "_target_" else None
            line = problem_line(f"{key}.{name}", value, rule, entry["who"]) if rule is not None else None
            if line is not None:
                raise ValueError(line)
    check_budget_early(cfg)


def check_budget_early(cfg: DictConfig) -> None:
    """`Method.check_budget`'s refusal of a budget below 1 (or null without ratio), as rules.json recorded it for
    the method at its defaults; a method with other values is left to `setup` (a field may lift the rule:
    Keyformer's budget_fraction)."""
    method = cfg.get("method")
    if not isinstance(method, DictConfig) or cfg.get("ratio") is not None:
        return
    entry = current(str(method.get("_target_", "")))
    budget = cfg.get("budget")
    if entry is None or entry.get("budget_refusal") is None:
        return
    values = {k: v for k, v in plain(method).items() if k != "_target_"}
    if any(json.dumps(v) != json.dumps(entry["defaults"].get(k, object()), default=str) for k, v in values.items()):
        return
    if budget is None or (isinstance(budget, int) and not isinstance(budget, bool) and budget < 1):
        raise ValueError(entry["budget_refusal"].replace("{budget}", repr(budget)))
