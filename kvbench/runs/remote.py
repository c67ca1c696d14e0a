"""A run against an OpenAI-compatible server (`model=openai`): the same samples, prompts (rendered with the model's
tokenizer here), stop rules and lengths as the in-process run, sent concurrently and streamed
(kvbench.remote.client); one record per reply in predictions.jsonl, with the server's usage and the request's
timings (ttft_s, tpot_s, e2e_s); the same scorers, scores.json and report. `python -m kvbench.run` takes this path
when `Run.remote` (kvbench.runs.api); a rerun skips finished ids; a failed request is a failure record."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from kvbench.remote.client import Timed, closed_loop, probe, replay
from kvbench.remote.spec import RemoteSpec, load_tokenizer
from kvbench.remote.wire import FINISH_TO_STOP, completion_body
from kvbench.runs.config import sample_seed
from kvbench.runs.failures import attempt, failure_record
from kvbench.runs.prompts import prompt_ids, render
from kvbench.runs.records import git_sha, manifest, write_scores

logger = logging.getLogger("kvbench.run")
logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise: the records have them
SERVER_FIELDS = ("kv_bytes", "full_kv_bytes", "kv_bytes_final", "effective_budget")  # taken from kvbench's server


class RemoteEngine:
    """The `Engine` of a run against a server: no weights, the model's tokenizer only. It builds the run's samples
    and request bodies, sends them (`replies`) and makes their records (`record`)."""

    def __init__(self, run):
        self.run = run
        self.spec: RemoteSpec = run.model
        self.tokenizer = load_tokenizer(self.spec)
        self.sampling = run.sampling()

    def samples(self, limit: int | None = None) -> list:
        spec = self.spec
        samples = self.run.dataset.build(self.tokenizer, spec.max_prompt_tokens, chat_template=spec.chat_template)
        return samples[:limit] if limit is not None else samples

    def prompt(self, sample) -> tuple[list[int], str | list[int]]:
        """(the prompt's token ids, as the in-process run has them; what is sent: those ids, or their text)."""
        ids = prompt_ids(sample, self.tokenizer, self.spec)
        if self.spec.send == "ids":
            return ids, ids
        if sample.input_ids is None:
            text, kwargs = render(self.tokenizer, sample.prompt, self.spec, sample.chat_template_kwargs)
            if self.tokenizer(text, **kwargs).input_ids == ids:  # not middle-cut: the text as rendered
                return ids, text
        bos = self.tokenizer.bos_token_id
        return ids, self.tokenizer.decode(ids[1:] if ids and bos is not None and ids[0] == bos else ids)

    def body(self, sample, prompt) -> dict:
        return completion_body(self.spec.model_name, prompt, sample.max_new_tokens, sample.stop,
                               sample.stop_token_ids, sample.min_new_tokens, self.sampling,
                               seed=sample_seed(self.run.cfg, sample))

    def bodies(self, samples, failed: Callable) -> list[tuple]:
        """(sample, ids, body) for each sample whose prompt can be made; `failed(sample, exception)` for one that
        cannot (too long for its rule): that sample's failure, the others go on."""
        jobs = []
        for sample in samples:
            try:
                ids, prompt = self.prompt(sample)
                jobs.append((sample, ids, self.body(sample, prompt)))
            except Exception as e:  # noqa: BLE001 - this sample's failure
                failed(sample, e)
        return jobs

    async def replies(self, bodies: Sequence[dict], arrival_s: Sequence[float | None] | None = None,
                      on_send=None):
        """`replay` against this run's server: `(i, Timed | Exception)` as each finishes; by default
        `model.concurrency` requests in flight (`on_send(i)`: request i goes out)."""
        spec = self.spec
        async for item in replay(spec.base_url, bodies, arrival_s or closed_loop(len(bodies), spec.concurrency),
                                 spec.timeout_s, spec.api_key_env, on_send=on_send):
            yield item

    def record(self, sample, ids: list[int], reply: Timed | Exception) -> dict:
        """The prediction record of one reply (or the failure record of a failed request)."""
        return attempt(sample, lambda: reply_record(self.run.dataset, sample, ids, reply, self.spec.send),
                       {"prompt_tokens": len(ids), "budget": None})

    def generate(self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int = 64,
                 stop: Sequence[str] = ()) -> list[Timed]:
        """Replies to `prompts` (text is rendered and tokenized as `Engine.encode` does), in their order; a failed
        request raises its exception after the others finished."""
        from kvbench.runs.prompts import encode

        bodies = []
        for p in prompts:
            ids = encode(self.tokenizer, p, self.spec) if isinstance(p, str) else list(p)
            bodies.append(completion_body(self.spec.model_name, ids if self.spec.send == "ids" or not isinstance(
                p, str) else render(self.tokenizer, p, self.spec)[0], max_new_tokens, stop, sampling=self.sampling))

        async def collect() -> dict:
            return {i: r async for i, r in self.replies(bodies)}

        out = asyncio.run(collect())
        for i in range(len(bodies)):
            if isinstance(out[i], Exception):
                raise out[i]
        return [out[i] for i in range(len(bodies))]


def reply_record(dataset, sample, ids: list[int], reply: Timed | Exception, send: str) -> dict:
    """A reply's record: the in-process record's sample fields and score, the server's usage, and the request's
    timings; accounting the server reports (kvbench's own `kvbench` object) is kept under `server`."""
    from kvbench.data.base import sha256_text

    if isinstance(reply, Exception):
        raise reply
    scores = dataset.score(sample, reply.text)
    server = reply.extra.get("kvbench") if isinstance(reply.extra.get("kvbench"), dict) else {}
    decode_s = reply.e2e_s - reply.ttft_s if reply.ttft_s is not None else None
    return {
        "id": sample.id, "prompt_sha256": sha256_text(sample.prompt), "prompt_tokens": len(ids), "query": "aware",
        "prediction": reply.text, "references": sample.answers, "score": scores[dataset.primary_metric],
        "scores": scores, "meta": sample.meta, "new_tokens": reply.tokens, "budget": server.get("budget"),
        "stop_reason": FINISH_TO_STOP.get(reply.finish_reason, reply.finish_reason or "unknown"),
        "sent": send, "sent_s": reply.sent_s, "ttft_s": reply.ttft_s, "tpot_s": reply.tpot_s, "e2e_s": reply.e2e_s,
        **({"decode_tok_s": (reply.tokens - 1) / decode_s} if decode_s and reply.tokens > 1 else {}),
        "usage": reply.usage, **({"server": reply.extra} if reply.extra else {}),
        **{k: server[k] for k in SERVER_FIELDS if isinstance(server.get(k), (int, float))},
    }


def server_manifest(cfg: DictConfig, method_name: str, dataset_name: str, dataset, spec: RemoteSpec, data_sha: str,
                    n_samples: int, models: dict) -> dict:
    """manifest.json of a run against a server: the in-process fields, and where the replies came from."""
    info = manifest(cfg, method_name, dataset_name, dataset, spec, data_sha, n_samples)
    info["server"] = {"base_url": spec.base_url, "model": spec.model_name, "tokenizer": spec.tokenizer,
                      "send": spec.send, "concurrency": spec.concurrency, "models": models.get("data")}
    return info


def run_remote_locked(cfg: DictConfig, run_dir: Path, store, run, choices: dict, shard) -> dict | None:
    """`runs.run.run_locked` for a run against a server (the run directory is locked by the caller)."""
    from kvbench.data.base import sha256_text
    from kvbench.runs.failures import note_if_nothing_succeeded, stop_on_signals

    spec: RemoteSpec = run.model
    manifest_name = shard.manifest_name if shard else "manifest.json"
    old = store.read_json(manifest_name)
    t_start = time.perf_counter()
    models = probe(spec.base_url, spec.model_name, spec.api_key_env)  # (validate probed too: nothing written then)
    engine = RemoteEngine(run)
    samples = engine.samples(cfg.limit)
    data_sha = sha256_text("\n".join(f"{s.id}\t{s.prompt}" for s in samples))
    store.write_text("config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    info = server_manifest(cfg, choices["method"], choices["dataset"], run.dataset, spec, data_sha, len(samples),
                           models)
    if shard is not None:
        info.update(shard=f"{shard.index}/{shard.count}", sample_ids=[s.id for s in samples],
                    dataset_skipped=dict(getattr(run.dataset, "skipped", {}) or {}))
        samples = shard.select(samples)
    if old is not None:
        info["started_utc"] = old.get("started_utc", info["started_utc"])
    store.write_json(manifest_name, info)
    done = store.done_ids(include_failed=not cfg.get("retry_failed", True))
    todo = [s for s in samples if s.id not in done]
    logger.info("run dir: %s | git %s | server %s (%s) | %d samples, %d already in predictions.jsonl", run_dir,
                git_sha(), spec.base_url, spec.model_name, len(samples), len(samples) - len(todo))
    jobs = engine.bodies(todo, lambda sample, e: store.append(failure_record(sample, e)))

    async def send_all() -> None:
        async for i, reply in engine.replies([body for _, _, body in jobs]):
            sample, ids, _ = jobs[i]
            store.append(engine.record(sample, ids, reply))

    try:
        with stop_on_signals():
            asyncio.run(send_all())
    except KeyboardInterrupt:
        logger.warning("stopped with %d of %d samples in %s; rerun the same command to resume",
                       len(store.done_ids()), len(samples), run_dir)
        raise
    info.update(finished_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                wall_s=round(time.perf_counter() - t_start, 2))
    store.write_json(manifest_name, info)
    if shard is not None:
        from kvbench.runs.merge import merge_when_complete

        store.close()
        return merge_when_complete(run_dir)
    records = store.records_on_disk()
    summary = write_scores(run_dir, records, samples, run.dataset, choices["dataset"], choices["method"], cfg, spec)
    note_if_nothing_succeeded(run_dir, records, summary)
    if cfg.report:
        try:
            from kvbench.report import write_run_report

            write_run_report(run_dir)
        except Exception as e:  # a plotting problem must never cost the predictions
            logger.warning("report for %s failed: %s", run_dir, e)
    logger.info("%s = %.4f over %d samples (%d failed) | %s", run.dataset.primary_metric,
                summary["metrics"].get(run.dataset.primary_metric, float("nan")), summary["n"], summary["n_failed"],
                run_dir)
    return summary
