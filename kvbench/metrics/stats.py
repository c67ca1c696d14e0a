"""How sure a score is: standard errors and paired bootstrap intervals, seeded numpy only.

KV-compression papers compare methods on averages of a few hundred samples; a 0.3-point gap can be noise. This
module gives every number its uncertainty, the way lm-evaluation-harness does:

- a mean over samples gets the analytic standard error, sample sd / sqrt(n) (`mean_se`);
- an average of group means (LongBench's or RULER's "Avg." over tasks) gets the se of that weighted mean of the
  samples, sqrt(sum_t w_t^2 sd_t^2 / n_t) (`stratified_mean_se`, `combine_se`), never the mean of the tasks' se's;
- samples that are not independent draws (the k generations of one problem, `dataset.samples=k`) are averaged per
  unit first, and the unit counts once (`unit_means`, `unit_mean_se`): pass@1's se is over problems, as R-KV's and
  lm-eval's; the paired bootstrap takes the same units (`paired_bootstrap(units=...)`);
- a score that is not a mean over samples (BUZZ's geometric-mean ROUGE, perplexity = exp of the mean NLL) gets a
  bootstrap se over samples (`CorpusMetric`, `bootstrap_se`), seeded, with the resample count recorded;
- two methods are compared by a paired bootstrap over the sample ids both ran (`pair_by_id`, `paired_bootstrap`):
  the 95 % percentile interval of the mean difference; a difference is called real when the interval excludes 0.

Every bootstrap draws from `numpy.random.default_rng(seed)`, so the same inputs and seed give the same interval.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Mapping, Sequence

import numpy as np

RESAMPLES = 2000          # bootstrap resamples by default (lm-eval uses more for its slow metrics; 2000 keeps a
SEED = 0                  # 95 % percentile interval's endpoints stable to about 1 % of its width)
LEVEL = 0.95
_CHUNK_ELEMENTS = 4_000_000   # resampled values held at once, so a 20k-sample run never allocates gigabytes


# --- standard errors of means -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Estimate:
    """A score with its standard error; `se` is None where it is undefined (fewer than two samples)."""
    mean: float | None
    se: float | None
    n: int

    def scaled(self, factor: float) -> "Estimate":
        return Estimate(None if self.mean is None else self.mean * factor,
                        None if self.se is None else self.se * factor, self.n)

    def to_dict(self) -> dict:
        return {"mean": self.mean, "se": self.se, "n": self.n}


def _clean(values: Iterable[float]) -> np.ndarray:
    """Float array without NaNs: a failed sample has no score and is left out, not counted as zero."""
    arr = np.asarray(list(values), dtype=float)
    return arr[~np.isnan(arr)]


def mean_se(values: Iterable[float]) -> Estimate:
    """Mean and standard error sd / sqrt(n), with the sample sd (ddof=1), as lm-eval's `mean_stderr`."""
    x = _clean(values)
    if len(x) == 0:
        return Estimate(None, None, 0)
    se = float(np.std(x, ddof=1) / math.sqrt(len(x))) if len(x) > 1 else None
    return Estimate(float(x.mean()), se, len(x))


def unit_means(values: Iterable[float], units: Iterable[Hashable]) -> tuple[np.ndarray, list]:
    """Each unit's mean of its values, in first-seen order, and the units: the samples of one unit (the generations
    of one problem) are one draw of the benchmark, not several. NaN values (failed samples) are left out first."""
    x = np.asarray(list(values), dtype=float)
    u = list(units)
    if len(u) != len(x):
        raise ValueError(f"stats: {len(u)} unit labels for {len(x)} samples")
    index: dict[Hashable, int] = {}
    keep = ~np.isnan(x)
    inverse = np.array([index.setdefault(k, len(index)) for k, ok in zip(u, keep) if ok], dtype=int)
    sums = np.bincount(inverse, weights=x[keep], minlength=len(index))
    return sums / np.bincount(inverse, minlength=len(index)), list(index)


def unit_mean_se(values: Iterable[float], units: Iterable[Hashable]) -> Estimate:
    """The mean over units of each unit's mean and its se, sd of the unit means / sqrt(units); n = units. With one
    sample per unit this is `mean_se`."""
    return mean_se(unit_means(values, units)[0])


def combine_se(ses: Sequence[float | None], weights: Sequence[float]) -> float | None:
    """se of sum_t w_t * mean_t for independent group means: sqrt(sum_t (w_t se_t)^2). None if any se is None."""
    if not ses or any(s is None for s in ses):
        return None
    return float(math.sqrt(sum((w * s) ** 2 for w, s in zip(weights, ses))))


def stratified_mean_se(values: Iterable[float], strata: Iterable[Hashable]) -> Estimate:
    """The plain mean over strata of each stratum's mean (e.g. "Avg." over tasks) and its se from the samples.

    Each stratum's mean has variance sd_t^2 / n_t from its own samples; with equal weights 1/T the average's se is
    sqrt(sum_t sd_t^2 / n_t) / T. Averaging the per-task se's instead would overstate it by up to sqrt(T).
    """
    x = np.asarray(list(values), dtype=float)
    s = np.asarray(list(strata), dtype=object)
    keep = ~np.isnan(x)
    groups = [mean_se(x[keep & (s == k)]) for k in dict.fromkeys(s[keep])]
    if not groups:
        return Estimate(None, None, 0)
    w = 1.0 / len(groups)
    return Estimate(float(sum(g.mean for g in groups) * w), combine_se([g.se for g in groups], [w] * len(groups)),
                    sum(g.n for g in groups))


# --- bootstrap ----------------------------------------------------------------------------------------------------
def _strata_index(n: int, strata: Sequence[Hashable] | None) -> list[np.ndarray]:
    if strata is None:
        return [np.arange(n)]
    s = np.asarray(list(strata), dtype=object)
    if len(s) != n:
        raise ValueError(f"stats: {len(s)} strata labels for {n} samples")
    return [np.flatnonzero(s == k) for k in dict.fromkeys(s)]


def bootstrap_distribution(data: np.ndarray, statistic: Callable[[np.ndarray], np.ndarray],
                           resamples: int = RESAMPLES, seed: int = SEED,
                           strata: Sequence[Hashable] | None = None) -> np.ndarray:
    """`statistic` on `resamples` resamples of the rows of `data` ([n] or [n, k]), drawn with replacement.

    `statistic` maps a batch of resamples [R, n, ...] to [R] (reduce over axis 1). With `strata`, rows are resampled
    within each stratum (its size kept) and `statistic` receives a list of one batch per stratum instead: the
    stratified bootstrap, for averages of group means. Vectorized, in chunks of resamples.
    """
    if resamples < 2:
        raise ValueError(f"stats: resamples={resamples} must be at least 2")
    data = np.asarray(data, dtype=float)
    rng = np.random.default_rng(seed)
    groups = _strata_index(len(data), strata)
    if any(len(g) == 0 for g in groups) or len(data) == 0:
        raise ValueError("stats: cannot bootstrap an empty sample")
    width = max(1, int(np.prod(data.shape[1:])))
    chunk = max(1, _CHUNK_ELEMENTS // (len(data) * width))
    out = []
    for start in range(0, resamples, chunk):
        r = min(chunk, resamples - start)
        batches = [data[g[rng.integers(0, len(g), size=(r, len(g)))]] for g in groups]
        out.append(np.asarray(statistic(batches if strata is not None else batches[0]), dtype=float))
    return np.concatenate(out)


def bootstrap_se(data: np.ndarray, statistic: Callable[[np.ndarray], np.ndarray], resamples: int = RESAMPLES,
                 seed: int = SEED) -> float | None:
    """Bootstrap standard error of `statistic` over samples (sd of its bootstrap distribution, ddof=1)."""
    if len(data) < 2:
        return None
    return float(np.std(bootstrap_distribution(data, statistic, resamples, seed), ddof=1))


# --- scores that are not means over samples --------------------------------------------------------------------
@dataclass(frozen=True)
class CorpusMetric:
    """A score computed from the whole set of samples, not a mean of per-sample scores.

    `columns` are per-sample numbers (record `scores` keys, else top-level record fields such as `nll_sum`);
    `statistic` maps an array [..., n, k] of those columns (k = len(columns)) to [...]. A dataset lists these in
    `corpus_metrics`; scores.json then carries the value and a bootstrap se (seed and resample count beside it).
    """
    columns: tuple[str, ...]
    statistic: Callable[[np.ndarray], np.ndarray]
    description: str = ""

    def value(self, table: np.ndarray) -> float:
        return float(self.statistic(table[None])[0])

    def estimate(self, table: np.ndarray, resamples: int = RESAMPLES, seed: int = SEED) -> dict:
        return {"mean": self.value(table), "se": bootstrap_se(table, self.statistic, resamples, seed),
                "n": len(table), "se_method": "bootstrap", "resamples": resamples, "seed": seed}


def geometric_mean_of_means(*columns: str) -> CorpusMetric:
    """BUZZ's "mean ROUGE": the geometric mean of the run's mean R-1, R-2 and R-L (Table 2); 0 if a mean is 0."""
    def statistic(x: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore"):  # log(0) = -inf -> exp gives 0, the paper's value for an empty ROUGE
            return np.exp(np.log(x.mean(axis=-2)).mean(axis=-1))
    return CorpusMetric(tuple(columns), statistic, f"geometric mean of the means of {', '.join(columns)}")


def exp_of_mean(column: str) -> CorpusMetric:
    """Perplexity from per-sample mean NLLs: exp of their mean."""
    return CorpusMetric((column,), lambda x: np.exp(x[..., 0].mean(axis=-1)), f"exp of the mean of {column}")


def exp_of_ratio(numerator: str, denominator: str) -> CorpusMetric:
    """Token-weighted perplexity: exp(sum of per-sample NLL sums / sum of per-sample token counts)."""
    return CorpusMetric((numerator, denominator), lambda x: np.exp(x[..., 0].sum(axis=-1) / x[..., 1].sum(axis=-1)),
                        f"exp of sum {numerator} / sum {denominator}")


def metric_stats(records: Sequence[dict], corpus: Mapping[str, CorpusMetric] | None = None,
                 resamples: int = RESAMPLES, seed: int = SEED) -> dict[str, dict]:
    """scores.json's `stats`: per metric its mean, se, n and how the se was computed.

    Per-sample metrics (record `scores`) get sd / sqrt(n) over the records that have them (a failure record
    without scores is skipped); each `corpus` metric gets a bootstrap se over the records that have all its columns.
    """
    names = sorted({m for r in records for m in (r.get("scores") or {})})
    out: dict[str, dict] = {}
    for m in names:
        est = mean_se(r["scores"][m] for r in records if m in (r.get("scores") or {}))
        out[m] = {**est.to_dict(), "se_method": "sd/sqrt(n)"}
    for name, cm in (corpus or {}).items():
        values = [[_field(r, c) for c in cm.columns] for r in records]
        rows = [v for v in values if None not in v]
        if rows:
            out[name] = {**cm.estimate(np.asarray(rows, dtype=float), resamples, seed), "of": cm.description}
    return out


def _field(record: dict, name: str) -> float | None:
    """A per-sample number: the record's `scores[name]`, else its top-level `name` (e.g. nll_sum, n_tokens)."""
    value = (record.get("scores") or {}).get(name, record.get(name))
    return None if value is None else float(value)


# --- paired comparison ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pairing:
    """Two runs' per-sample scores matched by sample id, plus the ids only one of them has (excluded)."""
    ids: list
    a: np.ndarray
    b: np.ndarray
    only_a: list
    only_b: list


def pair_by_id(a: Mapping[Hashable, float], b: Mapping[Hashable, float]) -> Pairing:
    """Match two runs' {sample id: score} by id; the order of either mapping does not matter. Samples without a
    score (NaN) count as unpaired."""
    def scored(m: Mapping) -> dict:
        return {k: float(v) for k, v in m.items() if v is not None and not math.isnan(float(v))}
    a, b = scored(a), scored(b)
    ids = sorted((k for k in a if k in b), key=str)
    return Pairing(ids, np.array([a[k] for k in ids], dtype=float), np.array([b[k] for k in ids], dtype=float),
                   sorted((k for k in a if k not in b), key=str), sorted((k for k in b if k not in a), key=str))


@dataclass(frozen=True)
class Interval:
    """The mean difference (a - b) over paired samples with its bootstrap se and percentile interval."""
    diff: float
    lo: float
    hi: float
    se: float
    n: int
    level: float
    resamples: int
    seed: int

    @property
    def excludes_zero(self) -> bool:
        return self.lo > 0 or self.hi < 0

    def scaled(self, factor: float) -> "Interval":
        return Interval(self.diff * factor, self.lo * factor, self.hi * factor, self.se * factor, self.n, self.level,
                        self.resamples, self.seed)


def _mean_of_stratum_means(batches: list[np.ndarray]) -> np.ndarray:
    return np.mean([b.mean(axis=1) for b in batches], axis=0)


def _per_unit(d: np.ndarray, units: Sequence[Hashable], strata: Sequence[Hashable] | None):
    """The differences averaged per unit, and each unit's stratum (its first sample's)."""
    means, keys = unit_means(d, units)
    if strata is None:
        return means, None
    first = dict(zip(reversed(list(units)), reversed(list(strata))))
    return means, [first[k] for k in keys]


def paired_statistic_bootstrap(a: np.ndarray, b: np.ndarray, statistic: Callable[[np.ndarray], np.ndarray],
                               resamples: int = RESAMPLES, seed: int = SEED, level: float = LEVEL) -> Interval | None:
    """Percentile interval of statistic(a) - statistic(b) for a score that is not a mean (geometric-mean ROUGE,
    perplexity): rows of `a` and `b` ([n, k], row i = the same sample id in both runs) are resampled together."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if len(a) < 2:
        return None
    k = a.shape[1]
    both = np.concatenate([a, b], axis=1)
    dist = bootstrap_distribution(both, lambda x: statistic(x[..., :k]) - statistic(x[..., k:]), resamples, seed)
    point = float(statistic(a[None])[0] - statistic(b[None])[0])
    alpha = (1 - level) / 2
    lo, hi = np.quantile(dist, [alpha, 1 - alpha])
    return Interval(point, float(lo), float(hi), float(np.std(dist, ddof=1)), len(a), level, resamples, seed)


def paired_bootstrap(diffs: Sequence[float], strata: Sequence[Hashable] | None = None, resamples: int = RESAMPLES,
                     seed: int = SEED, level: float = LEVEL,
                     units: Sequence[Hashable] | None = None) -> Interval | None:
    """Percentile bootstrap interval of the mean of paired differences (method - reference, one per sample id).

    With `strata` (e.g. each sample's task), the statistic is the mean over strata of the stratum means, the way
    "Avg." is computed, and samples are resampled within their stratum. With `units` (each sample's problem, where a
    problem ran several times), the differences are averaged per unit first and the units are resampled (a unit lies
    in one stratum); n is then the number of units. None for fewer than two pairs (units).
    """
    d = np.asarray(diffs, dtype=float)
    if units is not None:
        d, strata = _per_unit(d, units, strata)
    if len(d) < 2:
        return None
    if strata is None:
        dist = bootstrap_distribution(d, lambda x: x.mean(axis=1), resamples, seed)
        point = float(d.mean())
    else:
        dist = bootstrap_distribution(d, _mean_of_stratum_means, resamples, seed, strata)
        point = float(np.mean([d[g].mean() for g in _strata_index(len(d), strata)]))
    alpha = (1 - level) / 2
    lo, hi = np.quantile(dist, [alpha, 1 - alpha])
    return Interval(point, float(lo), float(hi), float(np.std(dist, ddof=1)), len(d), level, resamples, seed)
