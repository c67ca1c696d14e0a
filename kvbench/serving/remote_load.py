"""The load benchmark against an external OpenAI-compatible server (`model=openai`): the dataset's requests, as the
in-process load run builds them, sent through the client (kvbench.remote.client `replay`) at the arrival process's
times; one record per reply with the same `serving` timings, measured on the client.

The pool and the batch are the server's (RemoteServingSpec refuses them here). `running` is the client's own count
of requests in flight (sent, reply not yet ended) when each was sent, itself included; `queue_s` and
`reserved_bytes` come from the server where it reports them (kvbench's own server does, in each choice's `kvbench`
object). Records, resume and `summary.json` are bench.py's: the same run store and `figures.summarize`."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import asdict
from pathlib import Path

from kvbench.runs.config import budget_tag, config_hash
from kvbench.serving.bench import check as check_load, new_session
from kvbench.serving.figures import summarize
from kvbench.serving.spec import ServingSpec

logger = logging.getLogger(__name__)


def check(run, serving: ServingSpec) -> None:
    """What a load run against a server refuses, before anything is written: pool settings (the server's), what
    the load benchmark refuses of any run, and a server that does not answer or serves another model."""
    from kvbench.remote.client import probe
    from kvbench.serving.spec import RemoteServingSpec

    RemoteServingSpec(**asdict(serving))  # pool settings given: one line
    check_load(run, serving)
    spec = run.model
    probe(spec.base_url, spec.model_name, spec.api_key_env)


def run_dir_of(run, serving: ServingSpec) -> Path:
    """`<results_dir>/serving/<dataset>/<model.name>/<method>/<budget>-server-<arrival>-<hash>`: `server` where an
    in-process run has `pool<bytes>`; the hash covers the model node (base URL and tokenizer included)."""
    cfg = run.cfg
    tag = budget_tag(cfg.budget, cfg.ratio, cfg.method._target_)
    digest = config_hash(cfg.method, cfg.dataset, cfg.model, cfg.generation, cfg.seed, cfg.positions,
                         cfg.decode_compression, *(["ignore_eos"] if serving.ignore_eos else []))
    return (Path(serving.results_dir) / "serving" / run.choices.get("dataset", cfg.dataset.name) / cfg.model.name
            / run.choices.get("method", run.method.registry_name) / f"{tag}-server-{serving.process.tag}-{digest}")


def run_remote_load(run, serving: ServingSpec, out_dir: Path | None = None) -> dict:
    """Replay the run's dataset to its server with the arrival process; returns the summary (also in
    `<run dir>/summary.json`)."""
    from kvbench.runs.failures import failure_record, stop_on_signals
    from kvbench.runs.remote import RemoteEngine
    from kvbench.runs.store import RunStore

    check(run, serving)
    engine = RemoteEngine(run)
    samples = engine.samples(serving.limit)
    if serving.ignore_eos:  # as in-process: EOS and stop tokens held off until max_new_tokens (vLLM's min_tokens)
        samples = [dataclasses.replace(s, min_new_tokens=s.max_new_tokens) for s in samples]
    store = RunStore(out_dir or run_dir_of(run, serving))
    try:
        done = store.done_ids(include_failed=False)
        todo = [s for s in samples if s.id not in done]
        logger.info("serving: %s | server %s (%s) | %d requests, %d already done", store.dir, run.model.base_url,
                    run.model.model_name, len(todo), len(samples) - len(todo))
        jobs = engine.bodies(todo, lambda sample, e: store.append(failure_record(sample, e)))
        session = new_session()
        server = {"base_url": run.model.base_url, "model": run.model.model_name, "tokenizer": run.model.tokenizer,
                  "send": run.model.send}
        store.write_json("serving.json", {**asdict(serving), "server": server, "config": run.choices})
        in_flight = {"now": 0, "at_send": {}}

        def sent(i: int) -> None:
            in_flight["now"] += 1
            in_flight["at_send"][i] = in_flight["now"]

        async def send_all() -> None:
            arrival_s = serving.process.times(len(jobs))
            async for i, reply in engine.replies([body for _, _, body in jobs], arrival_s, on_send=sent):
                in_flight["now"] -= 1
                sample, ids, _ = jobs[i]
                record = engine.record(sample, ids, reply)
                if not record.get("failed"):
                    record["serving"] = timings(reply, in_flight["at_send"][i], session)
                store.append(record)

        try:
            with stop_on_signals():
                asyncio.run(send_all())
        except KeyboardInterrupt:
            logger.warning("stopped; rerun the same command to resume (%s)", store.dir)
            raise
        summary = {**summarize(store.records_on_disk(), *serving.slo_s), "pool_bytes": None,
                   "method": run.choices.get("method"), "budget": run.cfg.budget, "arrival": serving.process.tag,
                   "run_dir": str(store.dir), "server": server}
        store.write_json("summary.json", summary)
        return summary
    finally:
        store.close()


def timings(reply, running: int, session: str) -> dict:
    """One reply's `serving` fields, as bench.timings writes them, from the client's clock: arrival_s is when it
    was sent (seconds since the session's replay started), latencies from then; a reply with no text has its first
    token at its end. queue_s and reserved_bytes where the server reports them."""
    ttft = reply.ttft_s if reply.ttft_s is not None else reply.e2e_s
    server = reply.extra.get("kvbench") if isinstance(reply.extra.get("kvbench"), dict) else {}
    reported = {k: server[k] for k in ("queue_s", "reserved_bytes") if isinstance(server.get(k), (int, float))}
    return {"session": session, "arrival_s": reply.sent_s, "finish_s": reply.sent_s + reply.e2e_s, "ttft_s": ttft,
            "tpot_s": (reply.e2e_s - ttft) / (reply.tokens - 1) if reply.tokens > 1 else 0.0, "e2e_s": reply.e2e_s,
            "output_tokens": reply.tokens, "running": running, **reported, "wall_clock_utc": time.time()}
