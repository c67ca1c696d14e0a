"""Sample-major execution of a sweep (`hydra/launcher=grid`): one prefill per sample for every method x budget.

A sweep's configurations that share everything the prefill depends on (model, dataset, `limit`) form a group. The
group loads the model once and walks the samples: each sample is prefilled once with full attention while the
capture records what every pending configuration needs (the widest window of queries, and the column sums of each
accumulated-attention scorer: plain-softmax scorers (H2O, BUZZ) share one sum, Keyformer's noisy score gets its own
from that configuration's own noise generator). Then each configuration compresses its own copy of the prefilled
cache (`generation.Prefilled`) and decodes through `kvbench.engine.batching`: `batch_size` generations at once, whatever
configuration or sample they belong to (at the default 1, one at a time, exactly as `generate`). Each record goes
into its configuration's own run directory through the same seams as the basic launcher (`run.prompt_ids`,
`records.generated_record`, `records.write_scores`, `store.RunStore`): same run dirs, records, resume (per run dir, per
sample id), manifest and scores.json.

Methods that score each layer's prefill input (`scores_inputs`: KVzap's surrogate, Fast KVzip's gate) get their
scores from the shared prefill too: the capture runs every such configuration's own scorer on each layer's input.

Records equal the basic launcher's except for timings and memory (`prefill_s` is the shared prefill's time, and
`peak_kv_bytes` counts the shared prefill held next to the configuration's copy); `prefill_shared_by` says how many
configurations used that prefill. A sample pending for one configuration only runs as a plain sample (compressed
inside the prefill forward where the method allows). TailorKV shares the prefill (its storage layers are built
from a copy of the prefilled cache). Configurations whose prefill differs run their own, in the same sample loop:
BUZZ with `logn` (a temperature on the model's attention) and KVCache-Factory's H2O (its scores use their own
mask). Jobs the grid does not run sample-major go through `run.run` unchanged, after the groups: perplexity
datasets (teacher forcing), beam search, sharded jobs and datasets that ask a second question (LongBench v2's
CoT). No Hydra here: the launcher hands plain configs.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from kvbench.runs.api import Run
from kvbench.runs.config import config_hash, sample_budget, sample_seed
from kvbench.runs.records import generated_record, git_sha, manifest, write_scores
from kvbench.runs.run import collector_paused, prompt_ids, run
from kvbench.engine.batching import BatchedDecoder, Decoding, Request
from kvbench.cache import KVCache
from kvbench.data.base import sha256_text
from kvbench.runs.failures import failure_record, note_if_nothing_succeeded, stop_on_signals
from kvbench.engine.generation import Prefilled, prefill
from kvbench.methods.base import Kind
from kvbench.methods.decoding import DecodingMethod
from kvbench.runs.store import RunStore

logger = logging.getLogger(__name__)


@dataclass
class GridJob:
    """One configuration of the sweep, as the launcher resolved it."""

    cfg: DictConfig  # the job's config, without the `hydra` node
    run_dir: Path
    choices: dict[str, str]  # the group options picked (method, dataset, model): names in paths and manifests


@dataclass
class ConfigRun:
    """A configuration being run inside its group: its objects, its run directory and what it still has to do."""

    job: GridJob
    method: object
    dataset: object
    spec: object
    scorer: str | None = None  # the name of its column scorer in the shared capture (accumulated-attention methods)
    store: RunStore | None = None
    info: dict = field(default_factory=dict)
    done: set[str] = field(default_factory=set)
    decoding: Decoding | None = None  # its method, sampling and positions, for the batched decoder

    @property
    def cfg(self) -> DictConfig:
        return self.job.cfg

    @property
    def name(self) -> str:
        return getattr(self.method, "label", self.job.choices["method"])  # e.g. tailorkv-2


def prefill_key(cfg: DictConfig) -> str:
    """Configurations with the same key see the same prompts and the same prefill."""
    return config_hash(cfg.model, cfg.dataset, cfg.limit)


def runs_alone(cfg: DictConfig, dataset) -> str | None:
    """Why a job cannot run sample-major (it then runs as the basic launcher runs it), or None."""
    if "base_url" in cfg.model:
        return "a run against a server (model=openai: kvbench.runs.remote)"
    if getattr(dataset, "kind", None) == "perplexity":
        return "teacher-forced perplexity"
    if cfg.generation.get("num_beams", 1) > 1:
        return "beam search"
    if cfg.get("shard"):
        return "a shard"
    if getattr(dataset, "asks_follow_up", False):
        return "a second question after each reply (kvbench.runs.follow_up)"
    if cfg.get("query", "aware") != "aware":
        return "question-agnostic compression (the question is fed after each configuration's compression)"
    return None


def shares_prefill(config: ConfigRun, budget: int | None) -> bool:
    """False where the method changes the prefill itself or scores it under its own mask."""
    method = config.method
    if getattr(method, "logit_scale", None) is not None:  # BUZZ log n: a temperature on the model's attention
        return False
    return not (method.kind is Kind.EVICTOR and method.causal_block(budget) is not None)


def plan(jobs: list[GridJob]) -> tuple[list[list[ConfigRun]], list[ConfigRun]]:
    """Validate every job (before any weights load), merge jobs that share a run dir (`full` across budgets) and
    group the rest by prefill key, in sweep order; also returns the jobs that run alone. Raises ValueError /
    KeyError / FileNotFoundError on bad input."""
    groups: dict[str, list[ConfigRun]] = {}
    alone, seen = [], set()
    for job in jobs:
        method, dataset, spec = Run.from_config(job.cfg).job  # the API's checks (runs.config.setup)
        if job.run_dir in seen:
            continue
        seen.add(job.run_dir)
        config = ConfigRun(job, method, dataset, spec)
        if runs_alone(job.cfg, dataset):
            alone.append(config)
        else:
            groups.setdefault(prefill_key(job.cfg), []).append(config)
    for configs in groups.values():
        for i, config in enumerate(configs):
            if config.method.kind is Kind.EVICTOR and config.method.accumulates_attention:
                plain = type(config.method).row_score is DecodingMethod.row_score
                config.scorer = "softmax" if plain else f"config{i}"  # a plain softmax sum serves H2O and BUZZ alike
    return list(groups.values()), alone


def run_grid(jobs: list[GridJob]) -> dict[Path, dict]:
    """Run (or resume) every job; returns each run dir's scores.json content."""
    groups, alone = plan(jobs)
    summaries = {}
    for configs in groups:
        summaries.update(run_group(configs))
    for config in alone:
        logger.info("grid: %s runs on its own (%s)", config.job.run_dir, runs_alone(config.cfg, config.dataset))
        summaries[config.job.run_dir] = run(config.cfg, config.job.run_dir,
                                                   (config.method, config.dataset, config.spec), config.job.choices)
    return {job.run_dir: summaries[job.run_dir] for job in jobs}


def run_group(configs: list[ConfigRun]) -> dict[Path, dict]:
    from tqdm import tqdm

    t_start = time.perf_counter()
    spec, first = configs[0].spec, configs[0]
    batch_size = max(c.cfg.batch_size for c in configs)
    logger.info("grid: %d configurations share each prefill (%s on %s), %d decoding at once | git %s",
                len(configs), spec.name, first.job.choices["dataset"], batch_size, git_sha())
    with collector_paused():  # loading: transformers' modelling code imports here (AttentionCapture), then weights
        from kvbench.models import AttentionCapture, load

        model, tokenizer = load(spec)
        samples = first.dataset.build(tokenizer, spec.max_prompt_tokens, chat_template=spec.chat_template)
    if first.cfg.limit is not None:
        samples = samples[: first.cfg.limit]
    data_sha = sha256_text("\n".join(f"{s.id}\t{s.prompt}" for s in samples))
    provenance = getattr(first.dataset, "provenance", None)  # the one dataset built serves every configuration
    for config in configs:
        open_run(config, model, tokenizer, data_sha, len(samples), provenance)
    todo = [s for s in samples if any(s.id not in c.done for c in configs)]
    n_pending = sum(s.id not in c.done for s in todo for c in configs)
    logger.info("grid: %d samples x %d configurations, %d samples (%d generations) still pending", len(samples),
                len(configs), len(todo), n_pending)
    with stop_on_signals(), AttentionCapture(model) as capture:
        decoder = BatchedDecoder(model, tokenizer, first.method, capture, batch_size)
        for request, gen in tqdm(decoder.run(sample_requests(model, tokenizer, capture, configs, todo)),
                                 total=n_pending, desc="grid"):
            config, sample, ids, shared_by = request.tag
            record = generated_record(config.dataset, sample, ids, request.budget, gen)
            record["prefill_shared_by"] = shared_by
            config.store.append(record)
            config.done.add(sample.id)
    wall_s = round(time.perf_counter() - t_start, 2)
    return {c.job.run_dir: close_run(c, samples, wall_s, len(configs)) for c in configs}


def sample_requests(model, tokenizer, capture, configs: list[ConfigRun], todo: list) -> Iterator[Request]:
    """Sample-major: each sample's prefill, shared by the configurations that can share it, then one request per
    configuration still pending for that sample. Lazy, so a sample is prefilled when its first request joins the
    batch; a configuration whose budget cannot apply to the prompt gets its failure record here."""
    device = next(model.parameters()).device
    spec = configs[0].spec
    for sample in todo:
        shared = None  # the previous sample's prefill goes before this one's is made
        pending = [c for c in configs if sample.id not in c.done]
        try:
            ids = prompt_ids(sample, tokenizer, spec)
        except Exception as e:  # noqa: BLE001 - e.g. a prompt the tokenizer cannot encode: this sample fails
            for config in pending:
                config.store.append(failure_record(sample, e))
                config.done.add(sample.id)
            continue
        budgets = {}
        for config in pending:
            try:
                budgets[id(config)] = config_budget(config, len(ids))
            except ValueError as e:  # a ratio too small for this prompt: that sample fails, as in run.run
                config.store.append(failure_record(sample, e, prompt_tokens=len(ids),
                                                   budget=sample_budget(config.cfg, len(ids))))
                config.done.add(sample.id)
        pending = [c for c in pending if id(c) in budgets]
        input_ids = torch.tensor([ids], device=device)
        together = [c for c in pending if shares_prefill(c, budgets[id(c)])]
        if len(together) > 1:
            try:
                shared = dict(zip(map(id, together), share_prefill(model, capture, together,
                                                                   [budgets[id(c)] for c in together],
                                                                   input_ids, sample)))
            except Exception as e:  # noqa: BLE001 - each configuration then tries (and records) its own
                logger.warning("grid: the shared prefill of %s failed (%s); each configuration runs its own",
                               sample.id, e)
        for config in pending:
            prefilled = (shared or {}).get(id(config))
            yield Request.from_sample(sample, ids, budgets[id(config)], sample_seed(config.cfg, sample),
                                      device, tag=(config, sample, ids, len(together) if prefilled else 1),
                                      decoding=config.decoding, prefilled=prefilled)


def config_budget(config: ConfigRun, prompt_len: int) -> int | None:
    budget = sample_budget(config.cfg, prompt_len)
    if config.cfg.ratio is not None:
        try:
            config.method.check_budget(budget)
        except ValueError as e:
            raise ValueError(f"ratio={config.cfg.ratio} on a {prompt_len}-token prompt gives {e}") from None
    return budget


# --- the shared prefill ---------------------------------------------------------------------------------------
def share_prefill(model, capture, pending: list[ConfigRun], budgets: list, input_ids, sample) -> list[Prefilled]:
    """Prefill once for every pending configuration; returns each configuration's view of it."""
    capture.reset()
    capture.window = max(c.method.query_window for c in pending)
    states = {}
    for config, budget in zip(pending, budgets):
        if config.scorer is not None:  # started now: Keyformer's prefill noise comes from this state's generator
            state = config.method.start(input_ids.shape[1], budget, sample.max_new_tokens,
                                        sample_seed(config.cfg, sample))
            states[id(config)] = state
            capture.column_scores.setdefault(config.scorer, partial(config.method.row_score, state=state,
                                                                    decoding=False))
    text_config = model.config.get_text_config()
    for i, config in enumerate(pending):  # KVzap's surrogate, Fast KVzip's gate: each its own scores of the inputs
        if config.method.scores_inputs:
            capture.input_scorers[f"config{i}"] = partial(config.method.input_scores, config=text_config)
    cache = KVCache()
    t0 = time.perf_counter()
    logits = prefill(model, input_ids, cache)
    prefill_s = time.perf_counter() - t0
    seen = dict(capture.window_queries), dict(capture.window_bias), dict(capture.scaling)
    named_sums, input_scores = capture.named_column_sums, capture.named_input_scores
    capture.reset()
    return [Prefilled(cache, logits, prefill_s, states.get(id(c)), *seen, named_sums.get(c.scorer, {}),
                      input_scores.get(f"config{i}", {})) for i, c in enumerate(pending)]


# --- run directories, as `run.run` writes them ------------------------------------------------------------------
def open_run(config: ConfigRun, model, tokenizer, data_sha: str, n_samples: int, provenance: dict | None) -> None:
    cfg, run_dir = config.cfg, config.job.run_dir
    config.store = RunStore(run_dir)
    old = config.store.read_json("manifest.json")
    prepared = config.method.prepare(model, tokenizer, prefill=prefill)
    config.store.write_text("config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    info = manifest(cfg, config.name, config.job.choices["dataset"], config.dataset, config.spec, data_sha,
                    n_samples, provenance)
    info["launcher"] = "grid"
    if prepared is not None:
        info["method_prepared"] = prepared
    if cfg.get("paper_settings"):  # a paper preset: which table, and every choice made to rebuild it
        info["paper"] = OmegaConf.to_container(cfg.paper_settings, resolve=True)
    if old is not None:
        if old.get("data_sha256") != data_sha:
            logger.warning("the data differ from the earlier run in %s; finished ids are kept", run_dir)
        info["started_utc"] = old.get("started_utc", info["started_utc"])
    config.store.write_json("manifest.json", info)
    config.info = info
    config.done = config.store.done_ids(include_failed=not cfg.get("retry_failed", True))  # failures are retried
    config.decoding = Run(cfg, config.method, config.dataset, config.spec, {}).decoding()


def close_run(config: ConfigRun, samples, wall_s: float, n_configs: int) -> dict:
    cfg, run_dir, store = config.cfg, config.job.run_dir, config.store
    try:  # scores always come from the records on disk, written under the run's lock
        records = store.records_on_disk()
        summary = write_scores(run_dir, records, samples, config.dataset, config.job.choices["dataset"],
                               config.name, cfg, config.spec)
        config.info.update(finished_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"), wall_s=wall_s,
                           grid_configs=n_configs)  # wall_s: the whole group's, shared by its configurations
        store.write_json("manifest.json", config.info)
    finally:
        store.close()
    note_if_nothing_succeeded(run_dir, records, summary)
    if cfg.report:
        try:
            from kvbench.report import write_run_report

            with collector_paused():  # (pandas and matplotlib import here)
                write_run_report(run_dir)
        except Exception as e:  # a plotting problem must never cost the predictions
            logger.warning("report for %s failed: %s", run_dir, e)
    logger.info("%s = %.4f over %d samples | %s", config.dataset.primary_metric,
                summary["metrics"].get(config.dataset.primary_metric, float("nan")), summary["n"], run_dir)
    return summary
