"""Entry point: `python -m kvbench.run method=pyramidkv budget=128` (add `-m` and comma lists to sweep).

Composes model x method x dataset x budget with Hydra, validates everything before any weights load, runs each
sample through prefill -> compress -> decode, streams one JSON line per sample into the run directory, and writes
scores.json, a summary and (NIAH) a heatmap. Rerunning the same command resumes where it stopped.
The config side (setup, run-dir names) is kvbench.runs.config; what a run writes is kvbench.runs.records.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

import hydra
from omegaconf import DictConfig, OmegaConf

from kvbench.runs.config import (CONFIG_DIR, GROUPS, check_group_overrides, decode_compression, sample_budget,
                                 sample_seed)
from kvbench.runs.prompts import encode, prompt_ids, prompt_split, render  # noqa: F401  (grid and tests import them here)
from kvbench.runs.records import generated_record, git_sha, manifest, sample_record, write_scores

logger = logging.getLogger("kvbench.run")
INTERRUPTED = "kvbench: interrupted; every finished sample is kept, rerun the same command to resume"  # (run.py too)


# --- the run --------------------------------------------------------------------------------------------------
def run_sample(model, tokenizer, method, capture, dataset, sample, ids: list[int], budget, cfg: DictConfig,
               sampling, prefilled=None, question_len: int = 0) -> dict:
    """Generate one sample and score it: the prediction record that goes into predictions.jsonl.
    `prefilled` (`generation.Prefilled`): a prefill shared with other configurations (the grid launcher).
    `question_len` (`query=agnostic`): the prompt's last tokens, fed after the context is compressed."""
    import torch

    from kvbench.engine.batching import generate

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    device = next(model.parameters()).device
    seed = sample_seed(cfg, sample)
    if sampling.num_beams > 1:  # beam search: no stop strings/tokens beyond EOS (Keyformer's setting)
        from kvbench.engine.beam import beam_generate

        gen = beam_generate(model, tokenizer, method, capture, torch.tensor([ids], device=device), budget,
                            sample.max_new_tokens, sampling.num_beams, length_penalty=sampling.length_penalty,
                            early_stopping=sampling.early_stopping, positions=cfg.positions, seed=seed)
    else:
        gen = generate(model, tokenizer, method, capture, torch.tensor([ids], device=device), budget,
                       sample.max_new_tokens, sample.stop, sampling, positions=cfg.positions, seed=seed,
                       stop_token_ids=sample.stop_token_ids, min_new_tokens=sample.min_new_tokens,
                       compress_after=cfg.get("compress_after", "layer"), prefilled=prefilled,
                       question_len=question_len, recompress=decode_compression(cfg))
    return sample_record(dataset, sample, ids, budget, gen, cfg.get("query", "aware"), question_len)


def guarded_sample(model, tokenizer, method, capture, dataset, sample, cfg: DictConfig, spec, sampling,
                   defer=None) -> dict | None:
    """The sample's record (a prediction, a perplexity, or a failure record if anything in it raises:
    kvbench/runs/failures.py). With `defer` (batched decoding), a sample to generate goes to `defer((sample, ids,
    budget))` instead and None is returned."""
    from kvbench.runs.failures import attempt

    context: dict = {}

    def make() -> dict | None:
        agnostic = cfg.get("query", "aware") == "agnostic"
        ids, n_context = prompt_split(sample, tokenizer, spec, split=agnostic or method.window_is_question)
        question_len = len(ids) - n_context if n_context else 0  # no context before it: nothing to compress first
        # (ratio: of what is compressed; a question-window method (FINCH) compresses the question with the context)
        budget = context["budget"] = sample_budget(cfg, len(ids) - (question_len if agnostic else 0))
        context["prompt_tokens"] = len(ids)
        if cfg.ratio is not None:
            try:
                method.check_budget(budget)
            except ValueError as e:
                raise ValueError(f"ratio={cfg.ratio} on a {len(ids)}-token prompt gives {e}") from None
        if getattr(dataset, "kind", None) == "perplexity":  # teacher forcing, not generation
            from kvbench.engine.perplexity import perplexity_record

            return perplexity_record(model, method, capture, dataset, sample, budget, cfg.positions,
                                     sample_seed(cfg, sample))
        if defer is not None:
            return defer((sample, ids, budget, question_len))
        return run_sample(model, tokenizer, method, capture, dataset, sample, ids, budget, cfg, sampling,
                          question_len=question_len)

    return attempt(sample, make, context, on_failure=capture.reset)  # reset: drop the failed sample's cache


def conversation_records(model, tokenizer, method, capture, dataset, conversations: list[list], cfg: DictConfig,
                         spec, sampling, done: set[str]):
    """The conversations' records, one per turn (`meta["turn"]`), in completion order: `cfg.batch_size` answers
    decode together and a conversation rejoins the batch with its next turn (kvbench.engine.turns). Turns already in
    predictions.jsonl are skipped (replayed, not rewritten: a later turn needs the earlier ones on its cache). A
    failure gives failure records to the turns its conversation left unanswered; the others go on."""
    from kvbench.engine.turns import Conversation, Limits, converse_many
    from kvbench.runs.failures import failure_record

    query = cfg.get("query", "aware")
    playing: list = []
    for turns in conversations:  # what needs no weights first: a conversation that cannot start fails here
        first, mode = turns[0], turns[0].meta.get("turn_mode", "append")
        try:
            ids, n_context = prompt_split(first, tokenizer, spec, split=query == "agnostic")
            question_len = len(ids) - n_context if n_context else 0
            budget = sample_budget(cfg, len(ids) - question_len)
            if cfg.ratio is not None:
                method.check_budget(budget)
            text = "followup" if mode == "append" else "question"
            later = [tokenizer(t.meta[text], add_special_tokens=False).input_ids for t in turns[1:]]
            limits = [Limits(t.max_new_tokens, tuple(t.stop), tuple(t.stop_token_ids), t.min_new_tokens) for t in turns]
            playing.append(Conversation(ids, later, budget, first.max_new_tokens, tuple(first.stop), mode,
                                        question_len, sample_seed(cfg, first), tag=turns, per_turn=limits))
        except Exception as e:  # noqa: BLE001 - this conversation's failure; the run goes on
            yield from (failure_record(t, e) for t in turns if t.id not in done)
    answered = {id(c): 0 for c in playing}  # the turns each conversation has answered so far

    def fail(conversation, k: int, e: Exception):
        answered.pop(id(conversation), None)
        return (failure_record(t, e) for t in conversation.tag[k:] if t.id not in done)

    try:
        for conversation, k, gen in converse_many(model, tokenizer, method, capture, playing, cfg.batch_size,
                                                  sampling, cfg.positions, cfg.get("compress_after", "layer")):
            if isinstance(gen, Exception):
                yield from fail(conversation, k, gen)
                continue
            answered[id(conversation)] = k + 1
            turn = conversation.tag[k]
            if turn.id not in done:  # (a record that cannot be made fails this turn only: the next one is decoding)
                record = generated_record(dataset, turn, conversation.first_ids if k == 0 else
                                          conversation.turns[k - 1], conversation.budget, gen, query,
                                          conversation.question_len if k == 0 else 0)
                yield record if record.get("failed") else {**record, "turn": k, "turn_mode": conversation.mode}
    except Exception as e:  # the batching loop itself failed: every turn not answered yet fails with it
        capture.reset()
        for conversation in playing:
            if id(conversation) in answered:
                yield from fail(conversation, answered[id(conversation)], e)


def batched_records(model, tokenizer, method, capture, dataset, jobs: list, cfg: DictConfig, sampling,
                    desc: str = "", spec=None):
    """Decode `jobs` ((sample, ids, budget, question_len) each) with continuous batching and yield one record per
    sample, in completion order: a sample that failed gets its failure record and the others go on. A dataset that
    asks a second question (`asks_follow_up`) gets it asked after each first reply (kvbench.runs.follow_up; `spec`,
    the model's, says how to encode it). Should the batching loop itself raise, the samples it had not finished get
    failure records."""
    from tqdm import tqdm

    from kvbench.engine.batching import BatchedDecoder
    from kvbench.runs.failures import fail_remaining
    from kvbench.runs.follow_up import Asking

    asking = Asking(dataset, tokenizer, spec, cfg, method, next(model.parameters()).device)
    requests = [asking.request(*job) for job in jobs]
    written: set[str] = set()
    try:
        step = cfg.get("step", "eager")
        if step == "eager":
            kind, extra = BatchedDecoder, {}
        else:  # the static step (kvbench.engine.static); `setup` refused what it cannot run
            from kvbench.engine.static import StaticDecoder

            kind, extra = StaticDecoder, {"compile": step == "captured"}
        decoder = kind(model, tokenizer, method, capture, cfg.batch_size, sampling, cfg.positions,
                       compress_after=cfg.get("compress_after", "layer"), recompress=decode_compression(cfg), **extra)
        with tqdm(total=len(jobs), desc=desc) as progress:
            for request, outcome in decoder.run(requests):
                record = asking.record(request, outcome)
                if record is not None:  # (None: a first reply, its sample's second question on its way)
                    written.add(record["id"])
                    progress.update()
                    yield record
    except Exception as e:  # the batch itself failed: the samples it had not finished fail with it
        capture.reset()
        yield from fail_remaining(jobs, written, e)


def run(cfg: DictConfig, run_dir: Path, job=None, choices: dict[str, str] | None = None) -> dict:
    """Run (or resume) one configuration into `run_dir`; `job` is `setup(cfg)`'s result if already validated,
    `choices` the group options picked (default: Hydra's for the running job)."""
    from kvbench.runs.api import Run
    from kvbench.runs.shard import Shard
    from kvbench.runs.store import RunStore

    method, dataset, spec = job or Run.from_config(cfg).job
    choices = choices or _choices()
    shard = Shard.parse(cfg.get("shard"))
    store = RunStore(run_dir, shard)  # the lock, taken before weights load
    try:
        validated = Run(cfg, method, dataset, spec, choices)
        if validated.remote:  # model=openai: an external server generates (kvbench.runs.remote)
            from kvbench.runs.remote import run_remote_locked

            return run_remote_locked(cfg, run_dir, store, validated, choices, shard)
        return run_locked(cfg, run_dir, store, method, dataset, spec, choices, shard)
    finally:
        store.close()


def run_locked(cfg: DictConfig, run_dir: Path, store, method, dataset, spec, choices, shard) -> dict | None:
    """`run` while it holds the run directory: every write, scores.json and the manifest's last one included,
    happens under its lock, so a merge or a second run cannot interleave with it."""
    from tqdm import tqdm

    from kvbench.runs.cost import CostMeter, job_log_links
    from kvbench.runs.failures import note_if_nothing_succeeded, stop_on_signals
    from kvbench.engine.generation import prefill
    from kvbench.data.base import sha256_text

    method_name = getattr(method, "label", choices["method"])  # a variant's table name, e.g. tailorkv-2
    manifest_name = shard.manifest_name if shard else "manifest.json"
    old = store.read_json(manifest_name)  # a damaged manifest stops here, before weights load
    job_log_links(run_dir, shard)  # SLURM/submitit: the job's stdout/stderr linked under the run dir
    logger.info("run dir: %s | git %s", run_dir, git_sha())
    t_start = time.perf_counter()
    with collector_paused():  # loading: transformers' modelling code imports here (AttentionCapture), then weights
        from kvbench.models import AttentionCapture, load

        model, tokenizer = load(spec)
        prepared = method.prepare(model, tokenizer, prefill=prefill)
        samples = dataset.build(tokenizer, spec.max_prompt_tokens, chat_template=spec.chat_template)
    if cfg.limit is not None:
        samples = samples[: cfg.limit]
    data_sha = sha256_text("\n".join(f"{s.id}\t{s.prompt}" for s in samples))
    store.write_text("config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    info = manifest(cfg, method_name, choices["dataset"], dataset, spec, data_sha, len(samples))
    if shard is not None:  # merge needs the whole run's id order, and what the dataset skipped while building
        info.update(shard=f"{shard.index}/{shard.count}", sample_ids=[s.id for s in samples],
                    dataset_skipped=dict(getattr(dataset, "skipped", {}) or {}))
        samples = shard.select(samples)
        info["n_shard_samples"] = len(samples)
    if prepared is not None:
        info["method_prepared"] = prepared  # e.g. TailorKV's layer split, and how it was found
    if cfg.get("paper_settings"):  # a paper preset: which table, and every choice made to rebuild it
        info["paper"] = OmegaConf.to_container(cfg.paper_settings, resolve=True)
    if old is not None:
        if old.get("data_sha256") != data_sha:
            logger.warning("the data differ from the earlier run in %s (%s); finished ids are kept", run_dir,
                           "new tokenizer or data version?")
        info["started_utc"] = old.get("started_utc", info["started_utc"])
        if shard is None and "shards" in old:  # a merged run resumed unsharded keeps what its shards cost
            info["shards"] = old["shards"]
    meter = CostMeter.resume(model, old, t0=t_start)  # the session's time includes loading the model
    store.write_json(manifest_name, {**info, **meter.fields()})

    done = store.done_ids(include_failed=not cfg.get("retry_failed", True))  # failed samples are retried
    if shard is not None:  # what the folder's merged predictions.jsonl already holds is not run again
        from kvbench.runs.store import PREDICTIONS, predicted_ids

        done |= predicted_ids(run_dir / PREDICTIONS)
    todo = [s for s in samples if s.id not in done]
    logger.info("device %s | %d samples, %d already in predictions.jsonl", info["hardware"]["device"],
                len(samples), len(samples) - len(todo))
    from kvbench.runs.api import Run

    sampling = Run(cfg, method, dataset, spec, choices).sampling()
    window = method.query_window
    try:
        with stop_on_signals(), AttentionCapture(model, window=window) as capture:
            jobs = []
            for record in conversation_records(model, tokenizer, method, capture, dataset,  # niah_multiturn...
                                               conversations(samples, todo), cfg, spec, sampling, done):
                store.append(record)
                store.write_json(manifest_name, {**info, **meter.fields()})
            todo = [s for s in todo if "conversation" not in s.meta]
            batched = cfg.batch_size > 1 or cfg.get("step", "eager") != "eager" or getattr(
                dataset, "asks_follow_up", False)  # (the engine's loop decodes, and asks second questions)
            for sample in tqdm(todo, initial=len(samples) - len(todo), total=len(samples), desc=method_name,
                               disable=batched):
                record = guarded_sample(model, tokenizer, method, capture, dataset, sample, cfg, spec, sampling,
                                        defer=jobs.append if batched else None)
                if record is not None:
                    store.append(record)
                    store.write_json(manifest_name, {**info, **meter.fields()})  # a killed job's time still counts
            if jobs:  # continuous batching (kvbench.engine.batching); records arrive in completion order
                for record in batched_records(model, tokenizer, method, capture, dataset, jobs, cfg, sampling,
                                              desc=method_name, spec=spec):
                    store.append(record)
                    store.write_json(manifest_name, {**info, **meter.fields()})
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: every finished record is already on disk
        logger.warning("stopped with %d of %d samples in %s; rerun the same command to resume", len(store.done_ids()),
                       len(samples), run_dir)
        raise
    info.update(finished_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                wall_s=round(time.perf_counter() - t_start, 2))
    store.write_json(manifest_name, {**info, **meter.fields()})
    if shard is not None:  # scores.json covers the whole run: the last shard to finish merges them all
        from kvbench.runs.merge import merge_when_complete

        store.close()  # (the shard's own lock; merge takes the run directory's)
        return merge_when_complete(run_dir)
    records = store.records_on_disk()  # scores always come from the records on disk
    summary = write_scores(run_dir, records, samples, dataset, choices["dataset"], method_name, cfg, spec)
    note_if_nothing_succeeded(run_dir, records, summary)
    if cfg.report:
        try:
            from kvbench.report import write_run_report

            with collector_paused():  # (pandas and matplotlib import here)
                write_run_report(run_dir)
        except Exception as e:  # a plotting problem must never cost the predictions
            logger.warning("report for %s failed: %s", run_dir, e)
    logger.info("%s = %.4f over %d samples (%d failed) | KV bytes %.1f%% of full | %s", dataset.primary_metric,
                summary["metrics"].get(dataset.primary_metric, float("nan")), summary["n"], summary["n_failed"],
                100 * (summary.get("kv_ratio") or 0), run_dir)
    return summary


def conversations(samples: list, todo: list) -> list[list]:
    """The conversations (samples sharing `meta["conversation"]`, in turn order) with a turn still to do."""
    pending = {s.meta["conversation"] for s in todo if "conversation" in s.meta}
    groups: dict[str, list] = {}
    for s in samples:
        if s.meta.get("conversation") in pending:
            groups.setdefault(s.meta["conversation"], []).append(s)
    return [sorted(g, key=lambda s: s.meta["turn"]) for g in groups.values()]


def _choices() -> dict[str, str]:
    """The group options Hydra picked (`snapkv`, `niah`, ...): the names used in paths and manifests."""
    from hydra.core.hydra_config import HydraConfig

    return {g: HydraConfig.get().runtime.choices[g] for g in GROUPS}


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from kvbench.runs.api import Run

    try:
        job = Run.from_config(cfg).job  # every check before weights load (runs.config.setup)
    except (ValueError, KeyError, FileNotFoundError) as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        sys.exit(f"kvbench: {message}")
    from kvbench.runs.failures import Stopped
    from kvbench.runs.store import RunDirError

    from kvbench.methods.base import RefusedForModel
    from kvbench.remote.spec import ServerProblem

    try:
        run(cfg, Path(HydraConfig.get().runtime.output_dir), job)
    except (RunDirError, RefusedForModel, ServerProblem) as e:  # busy, a damaged manifest, a full disk; a setting
        sys.exit(f"kvbench: {e}")  # the model refuses; a server gone since the command line was checked
    except KeyboardInterrupt as e:  # 130 / 143: the shell's codes for SIGINT / SIGTERM
        print(INTERRUPTED.replace("interrupted", str(e) or "interrupted"), file=sys.stderr)
        sys.exit(128 + (e.signum if isinstance(e, Stopped) else 2))


LOADING_GEN0 = 100_000  # objects allocated between two young collections while loading (CPython's default: 700)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Few collections inside: for one-time loading (imports, weights, tokenizer, data, the report's pandas and
    matplotlib), whose objects mostly live on, so that collecting while they pile up would walk the growing heap again
    and again (~1 s of a one-sample run; docs/throughput.md). The young generation is still collected every
    LOADING_GEN0 allocations, so garbage that dies young (the configs a sweep's check composes) stays bounded; the
    older ones practically never. They are collected as usual afterwards (nothing is frozen here: a model holds
    reference cycles, and a sweep may load several)."""
    before = gc.get_threshold()
    gc.set_threshold(LOADING_GEN0, *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)


def started() -> None:
    """Start-up is over: what it built (torch, transformers, Hydra, kvbench: ~400k objects that live until exit) is
    moved out of the collector's sight, after one collection so that no garbage is kept."""
    gc.collect()
    gc.freeze()


def check_command_line(argv: list[str]) -> list[str]:
    """The arguments as Hydra will get them, after every check that needs no weights: on bad input the process ends
    with one line `kvbench: ...` (exit code 1) and nothing written."""
    from kvbench.runs.validate import validate_or_exit

    argv = [a[1:] if a.startswith("+paper=") else a for a in argv]  # paper is a default group (null)
    check_group_overrides(argv)
    validate_or_exit(argv)
    return argv


@contextlib.contextmanager
def hydra_errors_raised() -> Iterator[bool]:
    """Hydra prints an error raised in its own code (saving .hydra/ on a full disk) as a traceback and exits; with
    HYDRA_FULL_ERROR set it raises it instead, so `cli` can say it in one line. Yields whether the user set it."""
    before = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        yield before is not None
    finally:
        if before is None:
            del os.environ["HYDRA_FULL_ERROR"]
        else:
            os.environ["HYDRA_FULL_ERROR"] = before


def end_with(error: Exception) -> None:
    """Exit as Hydra would on an error of the job (the traceback below Hydra's own frames), except a full disk under
    Hydra's own writes (.hydra/, run.log): one line naming the run directory (Hydra's `run_job` frame holds it)."""
    import traceback

    from kvbench.runs.store import disk_full, is_disk_full

    job = error.__traceback__
    while job is not None and job.tb_frame.f_code.co_name != "run_job":
        job = job.tb_next
    if isinstance(error, OSError) and is_disk_full(error):
        where = error.filename or (job.tb_frame.f_locals.get("output_dir") if job is not None else None)
        sys.exit(f"kvbench: {disk_full(error, where)}")
    traceback.print_exception(type(error), error, job.tb_next if job is not None else error.__traceback__)
    sys.exit("\nSet the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.")


def cli() -> None:
    """`python -m kvbench.run ...`: the whole command line is checked before Hydra creates a run directory. Ends
    with exit code 1 and the first failure's cause when a run finished with no sample that succeeded.
    It owns the process's cyclic garbage collector: paused while start-up imports (`started`), frozen at exit.
    Ctrl-C anywhere (the start-up's imports and checks included) ends it with one line and exit code 130."""
    try:
        from kvbench.runs.failures import NOTHING_SUCCEEDED

        with collector_paused():  # start-up: torch, transformers and Hydra import while the command line is checked
            sys.argv[1:] = check_command_line(sys.argv[1:])
        started()
        with hydra_errors_raised() as user_asked_full_errors:
            try:
                main()
            except Exception as e:  # noqa: BLE001 - reported as Hydra would, a full disk in one line
                from kvbench.runs.store import is_disk_full

                if user_asked_full_errors and not (isinstance(e, OSError) and is_disk_full(e)):
                    raise
                end_with(e)
    except KeyboardInterrupt:  # outside the sample loop (which says it in main): while starting, or at the end
        print(INTERRUPTED, file=sys.stderr)
        sys.exit(130)
    finally:  # the interpreter's last collections would walk every object once more: 1-3 s here for nothing
        gc.freeze()
    if NOTHING_SUCCEEDED:
        sys.exit("\n".join(f"kvbench: {line}" for line in NOTHING_SUCCEEDED))

if __name__ == "__main__":
    cli()
