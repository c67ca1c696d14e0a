"""A configuration's serving figures, from its records only (so a resumed run's are rebuilt the same way).

Per request (bench.py writes them under `serving` in each record; remote_load.py too, with the client's timings,
and queue_s, reserved and KV bytes only where the server reports them): queue_s (arrival -> admitted), ttft_s
(arrival -> first token), tpot_s ((e2e - ttft) / (output tokens - 1)), e2e_s (arrival -> last token). Per configuration:
throughput over the wall time the requests spanned (each session's first arrival to its last finish, summed over
sessions), goodput (requests/s meeting both latency targets), p50/p90/p99 of each latency, the most requests running
at once, and accuracy with its standard error (kvbench.metrics.stats)."""
from __future__ import annotations

import numpy as np

from kvbench.metrics.stats import mean_se

LATENCIES = ("queue_s", "ttft_s", "tpot_s", "e2e_s")
PERCENTILES = (50, 90, 99)


def wall_s(records: list[dict]) -> float:
    """Seconds the records' sessions spanned, first arrival to last finish, summed over sessions."""
    spans: dict[str, list[float]] = {}
    for r in records:
        s = r["serving"]
        lo, hi = spans.setdefault(s["session"], [s["arrival_s"], s["finish_s"]])
        spans[s["session"]] = [min(lo, s["arrival_s"]), max(hi, s["finish_s"])]
    return sum(hi - lo for lo, hi in spans.values())


def summarize(records: list[dict], ttft_slo_s: float = float("inf"), tpot_slo_s: float = float("inf")) -> dict:
    """The figures of one configuration's records (failed ones count in `n_failed` only)."""
    ok = [r for r in records if not r.get("failed") and "serving" in r]
    wall = wall_s(ok)
    out = {"n": len(ok), "n_failed": len(records) - len(ok), "wall_s": round(wall, 4)}
    if not ok:
        return out
    tokens = sum(r["serving"]["output_tokens"] for r in ok)
    good = sum(r["serving"]["ttft_s"] <= ttft_slo_s and r["serving"]["tpot_s"] <= tpot_slo_s for r in ok)
    out.update(output_tok_s=tokens / wall if wall > 0 else None, requests_s=len(ok) / wall if wall > 0 else None,
               goodput_requests_s=good / wall if wall > 0 else None, ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s,
               peak_running=max(r["serving"]["running"] for r in ok),
               kv_reserved_bytes_mean=mean_of(r["serving"].get("reserved_bytes") for r in ok),
               kv_bytes_mean=mean_of(r.get("kv_bytes") for r in ok),
               accuracy=mean_se(r["score"] for r in ok).to_dict())
    for name in LATENCIES:
        values = np.array([r["serving"][name] for r in ok if r["serving"].get(name) is not None], dtype=float)
        if len(values):  # (a server that reports no queue time: no queue_s)
            out[name] = {f"p{p}": float(np.percentile(values, p)) for p in PERCENTILES}
    return out


def mean_of(values) -> float | None:
    """The mean of the values present (a server need not report KV bytes or reservations); None if none is."""
    present = [v for v in values if v is not None]
    return float(np.mean(present)) if present else None


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (higher is better on each: throughput, accuracy),
    in order of the first axis. Equal points are all kept."""
    front = [i for i, (x, y) in enumerate(points)
             if not any(x2 >= x and y2 >= y and (x2, y2) != (x, y) for x2, y2 in points)]
    return sorted(front, key=lambda i: points[i])
