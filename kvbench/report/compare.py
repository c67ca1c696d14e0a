"""`--compare METHOD`: each table cell's difference to a reference method, by a paired bootstrap over sample ids.

A gap between two rows of a table is only worth reporting if it is larger than what resampling the same prompts
would give. Two runs of one benchmark share sample ids, so the fair comparison is paired: per id, method score minus
reference score; its mean is the cell's difference, and a seeded percentile bootstrap over the ids gives the 95 %
interval (kvbench.metrics.stats.paired_bootstrap). An average over tasks ("Avg.") is bootstrapped within each task, so
it matches how the average is computed. Where a problem ran several times (`dataset.samples`, ids `<problem>#<k>`),
the problem is the unit: its paired differences are averaged and the problems resampled (`sample_units`). Ids only one
run has are left out and counted in the table's note.

The table modules (tables, longbench, ruler) call `Compare.cells` per row and mark a cell whose interval excludes 0.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Iterable

import pandas as pd

from kvbench.metrics.stats import (LEVEL, RESAMPLES, SEED, Interval, pair_by_id, paired_bootstrap,
                                   paired_statistic_bootstrap)
from kvbench.report.labels import METHOD_NAMES, method_label

MARK = "†"           # appended to a cell whose interval excludes 0 (not "*", which Markdown bold would eat)
# fewer paired units than this: no mark, a warning in the note. A percentile bootstrap over 2 samples that agree has
# the one-point interval [d, d], which "excludes 0" without meaning anything
MIN_PAIRED = 10


def significant(ci: Interval | None) -> bool:
    """Whether a cell gets the mark: its interval excludes 0 and rests on at least MIN_PAIRED paired units."""
    return ci is not None and ci.excludes_zero and ci.n >= MIN_PAIRED


QUERY_MODES = ("aware", "agnostic")  # `--compare aware`: each agnostic row against its own method's aware row


def resolve_reference(label: str, methods: Iterable[str], queries: Iterable[str]) -> tuple[str, str]:
    """(`method` or `query`, reference): `--compare aware` / `--compare agnostic` (a query mode the runs hold)
    pairs each row with the same method, budget and sample ids in the other mode; anything else names a method."""
    if label.lower() in QUERY_MODES and label.lower() in set(map(str, queries)):
        return "query", label.lower()
    return "method", resolve_method(label, methods)


def resolve_method(label: str, methods: Iterable[str]) -> str:
    """The registry name of `label` (registry name or paper spelling, any case) among the runs' methods."""
    methods = sorted(set(map(str, methods)))
    for m in methods:
        if label.lower() in (m.lower(), method_label(m).lower()):
            return m
    known = ", ".join(methods)
    raise ValueError(f"kvbench: report --compare {label!r} is not a method in these runs; choose one of: {known}")


def reference_key(row: dict, candidates: list[dict], keys: list[str]) -> dict | None:
    """The reference configuration a row is compared with: the one at the same budget and ratio (e.g. `--compare
    snapkv` compares each KV size with SnapKV at that size); the full cache keeps everything, so any full-cache run
    will do. None when the reference did not run at the row's budget."""
    same = [c for c in candidates if all(_same(c.get(k), row.get(k)) for k in keys)]
    if same:
        return same[0]
    if candidates and candidates[0].get("method") == "full":  # the same query mode's full cache if it ran
        return next((c for c in candidates if _same(c.get("query"), row.get("query"))), candidates[0])
    return None


def _same(a, b) -> bool:
    a_na, b_na = a is None or pd.isna(a), b is None or pd.isna(b)
    return a_na and b_na if a_na or b_na else a == b


def select(records: pd.DataFrame, row, keys: list[str]) -> pd.DataFrame:
    """The records of one table row: equal on every key, a missing key (full cache's budget) matching missing."""
    mask = pd.Series(True, index=records.index)
    for k in keys:
        v = row.get(k)
        mask &= records[k].isna() if v is None or pd.isna(v) else records[k] == v
    return records[mask]


UNIT = "meta.problem"  # the reasoning sets' problem of a sample (kvbench.data.reasoning), k samples each


def sample_units(records: pd.DataFrame) -> pd.Series:
    """Each record's unit of resampling: its problem where the dataset ran each problem several times (those k
    generations are one draw of the benchmark, not k), else its own id. Indexed like `records`."""
    ids = records["id"] if "id" in records else records.index.to_series(index=records.index)
    return records[UNIT].where(records[UNIT].notna(), ids) if UNIT in records else ids


def _by_id(records: pd.DataFrame) -> pd.DataFrame:
    """One row per sample id (a resumed run may hold an id twice: the last record wins, as in scores.json)."""
    return records.drop_duplicates("id", keep="last").set_index("id")


@dataclass
class Compare:
    """One comparison setting: the reference method (registry name), resamples, seed and level; collects the
    unpaired-sample counts of every row it compared, for the table's note."""
    reference: str
    resamples: int = RESAMPLES
    seed: int = SEED
    level: float = LEVEL
    unpaired: list[tuple[str, int, int]] = field(default_factory=list)
    axis: str = "method"  # "query": `reference` is a query mode, each row compared with its own method in it
    per_problem: bool = False  # some row's samples repeated a problem: its differences were averaged per problem
    few: list[tuple[str, int]] = field(default_factory=list)  # (label, n) of cells under MIN_PAIRED paired units

    def cells(self, method: pd.DataFrame, reference: pd.DataFrame, label: str, scale: float = 1.0,
              task: str | None = None, tasks: list[str] | None = None,
              average: str = "Avg.") -> dict[Hashable, Interval | None]:
        """Intervals of (method - reference) x scale over the ids both record frames hold (columns id, score and
        `task`). Without `task`: {"score": interval}. With it: one per task in `tasks` and `average` for the mean
        over those tasks (stratified by task; None unless the paired samples cover every task)."""
        m, r = _by_id(method), _by_id(reference)
        pairing = pair_by_id(m["score"].astype(float).to_dict(), r["score"].astype(float).to_dict())
        entry = (label, len(pairing.only_a), len(pairing.only_b))
        if (pairing.only_a or pairing.only_b) and entry not in self.unpaired:
            self.unpaired.append(entry)
        diffs = pd.Series(pairing.a - pairing.b, index=pairing.ids, dtype=float)
        units = sample_units(m).reindex(pairing.ids)
        self.per_problem |= units.nunique() < len(units)
        if task is None:
            return {"score": self._counted(label, self._interval(diffs.to_numpy(), None, scale, units.to_numpy()))}
        strata = m.loc[pairing.ids, task] if len(pairing.ids) else pd.Series(dtype=object)
        out: dict[Hashable, Interval | None] = {
            t: self._interval(diffs[strata == t].to_numpy(), None, scale, units[strata == t].to_numpy())
            for t in tasks or []}
        keep = strata.isin(tasks or [])
        out[average] = (self._interval(diffs[keep].to_numpy(), strata[keep].to_numpy(), scale,
                                       units[keep].to_numpy()) if tasks and set(tasks) <= set(strata) else None)
        for key, ci in out.items():
            self._counted(f"{label} {key}", ci)
        return out

    def statistic_cell(self, method: pd.DataFrame, reference: pd.DataFrame, label: str, columns: list[str],
                       statistic, scale: float = 1.0) -> Interval | None:
        """The interval of statistic(method) - statistic(reference) over the ids both have values in `columns` for,
        for a score that is not a mean of per-sample scores (kvbench.metrics.stats.paired_statistic_bootstrap)."""
        m, r = _by_id(method)[columns].astype(float).dropna(), _by_id(reference)[columns].astype(float).dropna()
        ids = sorted(set(m.index) & set(r.index), key=str)
        only_m, only_r = len(set(m.index) - set(ids)), len(set(r.index) - set(ids))
        if (only_m or only_r) and (label, only_m, only_r) not in self.unpaired:
            self.unpaired.append((label, only_m, only_r))
        ci = paired_statistic_bootstrap(m.loc[ids].to_numpy(), r.loc[ids].to_numpy(), statistic, self.resamples,
                                        self.seed, self.level)
        return self._counted(label, None if ci is None else ci.scaled(scale))

    def _counted(self, label: str, ci: Interval | None) -> Interval | None:
        """`ci`, noted for the table's warning when it rests on fewer than MIN_PAIRED paired units."""
        if ci is not None and ci.n < MIN_PAIRED and (label, ci.n) not in self.few:
            self.few.append((label, ci.n))
        return ci

    def _interval(self, diffs, strata, scale: float, units=None) -> Interval | None:
        ci = paired_bootstrap(diffs, strata, self.resamples, self.seed, self.level, units)
        return None if ci is None else ci.scaled(scale)

    def note(self) -> list[str]:
        """The lines under a compared table: what the mark means, resamples, seed, and the unpaired samples."""
        ref = f"the same method with query={self.reference}" if self.axis == "query" else \
            METHOD_NAMES.get(self.reference, self.reference)
        unit = "; a problem's samples averaged, problems resampled" if self.per_problem else ""
        lines = [f"{MARK} the {self.level:.0%} paired-bootstrap interval of the difference to {ref} excludes 0 "
                 f"(samples paired by id{unit}; {self.resamples} resamples, seed {self.seed})."]
        if self.few:
            lines.append(f"Too few paired samples for a test (under {MIN_PAIRED}), never marked: " + "; ".join(
                f"{label}: n={n}" for label, n in self.few) + ".")
        if self.unpaired:
            lines.append("Unpaired samples, excluded: " + "; ".join(
                f"{label}: {a} ids only in this run, {b} only in {ref}'s" for label, a, b in self.unpaired) + ".")
        return lines


def fmt_interval(ci: Interval | None) -> str:
    """`-33.33 [-58.33, -8.33]†`: difference, interval, and the mark when the interval excludes 0."""
    if ci is None:
        return "–"
    return f"{ci.diff:+.2f} [{ci.lo:+.2f}, {ci.hi:+.2f}]" + (MARK if significant(ci) else "")
