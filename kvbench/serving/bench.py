"""The load benchmark: a dataset's requests replayed into the engine under a KV pool, one record per request.

`run_load(engine, serving)` builds the run's samples, reserves each request's bound (kvbench.serving.pool) in a
pool of `pool_bytes`, lets them arrive (kvbench.serving.arrivals) and join the engine's continuous batching when
they fit, and writes each finished request's prediction record, with its `serving` timings, to
`<results_dir>/serving/<dataset>/<model>/<method>/<budget>-pool<bytes>-<arrival>-<hash>/predictions.jsonl`
(kvbench.runs.store: flushed per line, locked, resumable: a rerun skips the ids already there). `summary.json` holds
the figures (kvbench.serving.figures) over every record on disk. The bytes the running caches hold are checked
against the pool after every step (`held_peak_bytes`); `on_step` lets a caller look too."""
from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from kvbench.runs.config import budget_tag, config_hash
from kvbench.serving.arrivals import PoolSource
from kvbench.serving.figures import summarize
from kvbench.serving.pool import KVPool, KVShape, check_bounded, reserved_entries
from kvbench.serving.spec import ServingSpec

logger = logging.getLogger(__name__)


def check(run, serving: ServingSpec) -> None:
    """What needs no weights: the method has a bound the pool can admit by."""
    from kvbench.runs.config import decode_compression

    check_bounded(run.method, decode_compression(run.cfg).on)
    if run.cfg.generation.get("num_beams", 1) > 1:
        raise ValueError("serving: the load benchmark decodes greedily or by sampling; use generation.num_beams=1")
    if run.cfg.get("query", "aware") != "aware":
        raise ValueError("serving: requests are replayed question-aware (the whole prompt prefilled, then compressed); "
                         "use query=aware")
    dataset = run.dataset
    if getattr(dataset, "kind", None) == "perplexity" or getattr(dataset, "turns", 1) > 1 \
            or getattr(dataset, "asks_follow_up", False):
        raise ValueError(f"serving: dataset {dataset.name} is not one prompt -> one reply per sample (perplexity, "
                         "conversations, a second question); use a generation dataset such as niah, ruler, gsm8k or "
                         "longbench")


def full_pool_bytes(requests, shape: KVShape, n: float) -> int:
    """A pool for `n` full-cache requests of the longest prompt (with its max_new_tokens) of `requests`."""
    longest = max(r.input_ids.shape[-1] + r.max_new_tokens for r in requests)
    return int(n * longest * shape.entry_bytes)


def run_dir_of(run, serving: ServingSpec, pool_bytes: int) -> Path:
    cfg = run.cfg
    tag = budget_tag(cfg.budget, cfg.ratio, cfg.method._target_)
    digest = config_hash(cfg.method, cfg.dataset, cfg.model, cfg.generation, cfg.seed, cfg.positions,
                         cfg.decode_compression, serving.max_batch, *(["ignore_eos"] if serving.ignore_eos else []))
    return (Path(serving.results_dir) / "serving" / run.choices.get("dataset", cfg.dataset.name) / cfg.model.name
            / run.choices.get("method", run.method.registry_name)
            / f"{tag}-pool{pool_bytes}-{serving.process.tag}-{digest}")


def run_load(engine, serving: ServingSpec, out_dir: Path | None = None, on_step=None) -> dict:
    """Replay the run's dataset under the pool; returns the summary (also in `<run dir>/summary.json`)."""
    from kvbench.runs.failures import failure_record
    from kvbench.runs.store import RunStore

    run = engine.run
    check(run, serving)
    samples = engine.samples(serving.limit)
    requests = [engine.sample_request(s) for s in samples]
    if serving.ignore_eos:  # fixed output lengths: EOS and stop tokens held off until max_new_tokens
        requests = [dataclasses.replace(r, min_new_tokens=r.max_new_tokens) for r in requests]
    shape = KVShape.of(engine.model)
    pool_bytes = serving.pool_bytes or full_pool_bytes(requests, shape, serving.pool_requests)
    store = RunStore(out_dir or run_dir_of(run, serving, pool_bytes))
    try:
        done = store.done_ids(include_failed=False)
        requests = [r for r in requests if r.tag[0].id not in done]
        logger.info("serving: %s | pool %d bytes | %d requests, %d already done", store.dir, pool_bytes,
                    len(requests), len(samples) - len(requests))
        reserved = [reserved_entries(run.method, r.input_ids.shape[-1], r.budget, r.max_new_tokens)
                    * shape.entry_bytes for r in requests]
        pool = KVPool(pool_bytes)
        source = PoolSource(requests, reserved, pool, serving.process)
        decoder = engine.decoder(serving.max_batch)
        held = {"peak": 0, "steps": 0}

        def step(active) -> None:
            nbytes = sum(slot.run.cache.nbytes() for slot in active)
            assert nbytes <= pool.used_bytes <= pool.capacity_bytes, (nbytes, pool.used_bytes)
            held["peak"], held["steps"] = max(held["peak"], nbytes), held["steps"] + 1
            if on_step is not None:
                on_step(active, pool)

        decoder.on_join = lambda slot: source.joined(slot, len(decoder.active))
        decoder.on_step = step
        session = new_session()
        store.write_json("serving.json", {**asdict(serving), "pool_bytes": pool_bytes,  # (the bytes it ran with)
                                          "entry_bytes": shape.entry_bytes, "config": run.choices})
        for request, outcome in decoder.run(source):
            timeline = source.finished(request)
            record = engine.record(request, outcome)
            if not record.get("failed"):
                record["serving"] = timings(timeline, len(outcome.token_ids), session)
            store.append(record)
        for request in source.rejected:
            sample = request.tag[0]
            store.append(failure_record(sample, ValueError(
                f"serving: its reservation ({source.of(request).reserved_bytes} bytes) exceeds the pool "
                f"({pool_bytes} bytes)")))
        summary = {**summarize(store.records_on_disk(), *serving.slo_s),
                   "pool_bytes": pool_bytes, "held_peak_bytes": held["peak"], "steps": held["steps"],
                   "pool_peak_reserved_bytes": pool.peak_bytes, "method": run.choices.get("method"),
                   "budget": run.cfg.budget, "arrival": serving.process.tag, "run_dir": str(store.dir)}
        store.write_json("summary.json", summary)
        return summary
    finally:
        store.close()


def new_session() -> str:
    """A load session's id: when it started, and unique (two sessions of one process can start within the same
    second on a fast machine)."""
    return f"{datetime.now(timezone.utc).isoformat(timespec='seconds')}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def timings(timeline, output_tokens: int, session: str) -> dict:
    """One request's `serving` fields (seconds since its session's start, and latencies from its arrival)."""
    ttft = timeline.first_token_s - timeline.arrival_s
    e2e = timeline.finish_s - timeline.arrival_s
    return {"session": session, "arrival_s": timeline.arrival_s, "admit_s": timeline.admit_s,
            "finish_s": timeline.finish_s, "queue_s": timeline.admit_s - timeline.arrival_s, "ttft_s": ttft,
            "tpot_s": (e2e - ttft) / (output_tokens - 1) if output_tokens > 1 else 0.0, "e2e_s": e2e,
            "output_tokens": output_tokens, "reserved_bytes": timeline.reserved_bytes, "running": timeline.running,
            "wall_clock_utc": time.time()}
