"""What a run writes besides the loop: manifest.json, one sample's prediction record, scores.json.

The basic launcher (kvbench.runs.run), the grid launcher (kvbench.runs.grid) and merge (kvbench.runs.merge) write
through these functions, so a record or a score cannot differ with the way the run was executed.
"""
from __future__ import annotations

import platform
import resource
import subprocess
from datetime import datetime, timezone
from pathlib import Path

from omegaconf import DictConfig

from kvbench.runs.config import CONFIG_DIR
from kvbench.runs.failures import attempt
from kvbench.runs.store import aggregate, is_failure, latest_per_id, write_json_atomic


def git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=CONFIG_DIR.parent, capture_output=True, text=True,
                             timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def recorded_budget(cfg) -> int | None:
    """The run's budget as its manifest and summary state it: None on a ratio run, whose budget is set per sample
    from its prompt length (each record carries its own); the config's default budget was never used there."""
    return None if cfg.ratio is not None else cfg.budget


def manifest(cfg, method_name, dataset_name, dataset, spec, data_sha, n_samples, provenance=None) -> dict:
    """manifest.json's fields at a run's start. `dataset_provenance`: where the data came from (the download
    script's provenance.json: source, revision, the commit read; RULER's length tokenizer), `provenance` or the
    built dataset's own."""
    import importlib.metadata as md

    import torch

    import kvbench
    from kvbench.models.loader import describe_source, resolve_device

    provenance = provenance or getattr(dataset, "provenance", None)
    versions = {}
    for pkg in ("torch", "transformers", "hydra-core", "rouge-score", "rouge", "jieba", "fuzzywuzzy",
                "python-Levenshtein", "wonderwords", "nltk", "numpy", "gguf", "math-verify", "latex2sympy2_extended"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    return {
        "kvbench_version": kvbench.__version__, "git_sha": git_sha(),
        "method": method_name, "budget": recorded_budget(cfg), "ratio": cfg.ratio,
        "query": cfg.get("query", "aware"),  # aware: the question prefilled before compression | agnostic: after
        "model": spec.name, "model_source": describe_source(spec),
        "dataset": dataset_name, "dataset_version": getattr(dataset, "version", None),
        "primary_metric": getattr(dataset, "primary_metric", None), "data_sha256": data_sha,
        "versions": versions,
        "hardware": {"device": resolve_device(spec.device), "cpu": platform.processor() or platform.machine(),
                     "threads": torch.get_num_threads(),
                     "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
        "started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"), "finished_utc": None,
        "n_samples": n_samples, "wall_s": None,
        **({"dataset_provenance": provenance} if provenance else {}),
    }


def peak_mem_bytes() -> int:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB; process-lifetime peak


def sample_record(dataset, sample, ids: list[int], budget, gen, query: str = "aware", question_len: int = 0) -> dict:
    """The prediction record of one generated sample (the same at any batch size, timings aside). `query`: when the
    question was fed (aware: before compression; agnostic: its `question_tokens` after it). Under aware a method
    whose window is the question (FINCH) also records `question_tokens`: the window it scored with."""
    from kvbench.data.base import sha256_text  # (kvbench.data registers every builder: not at the command's start)

    scores = dataset.score(sample, gen.text)
    return {
        "id": sample.id, "prompt_sha256": sha256_text(sample.prompt), "prompt_tokens": len(ids), "query": query,
        **({"question_tokens": question_len} if question_len else {}),
        "prediction": gen.text, "references": sample.answers,
        "score": scores[dataset.primary_metric], "scores": scores, "meta": sample.meta,
        "new_tokens": len(gen.token_ids), "budget": budget,
        "kept_per_layer": gen.kept_per_layer, "kept_per_head": gen.kept_per_head,
        "kept_head_stats": gen.kept_head_stats,
        "kv_bytes": gen.kv_bytes, "full_kv_bytes": gen.full_kv_bytes, "kv_bytes_final": gen.kv_bytes_final,
        "kv_bytes_per_layer": gen.kv_bytes_per_layer, "kv_bytes_per_layer_final": gen.kv_bytes_per_layer_final,
        "host_kv_bytes": gen.host_kv_bytes,
        "effective_budget": gen.effective_budget, **gen.timings, "peak_mem_bytes": peak_mem_bytes(),
        "peak_kv_bytes": gen.peak_kv_bytes, "kv_bytes_peak": gen.kv_bytes_decode_peak,
        "kv_bytes_mean": gen.kv_bytes_decode_mean, "stop_reason": gen.stop_reason, "step": gen.step,
        **({"transfers": gen.transfers} if gen.transfers is not None else {}),
        **({"state_bytes": gen.state_bytes} if gen.state_bytes else {}),  # a hybrid's recurrent state (constant)
    }


def generated_record(dataset, sample, ids: list[int], budget, gen, query: str = "aware", question_len: int = 0) -> dict:
    """The record of a sample that batched decoding finished: its prediction, or the failure it yielded."""
    def make() -> dict:
        if isinstance(gen, Exception):
            raise gen
        return sample_record(dataset, sample, ids, budget, gen, query, question_len)

    return attempt(sample, make, {"prompt_tokens": len(ids), "budget": budget})


# a second request's record fields that belong to the sample, not to that request (kvbench.runs.follow_up)
SAMPLE_FIELDS = ("id", "query", "prediction", "references", "score", "scores")


def followed_record(dataset, sample, first: dict, follow, follow_ids: list[int], budget, gen, query: str = "aware",
                    question_len: int = 0) -> dict:
    """The record of `sample` asked twice (kvbench.runs.follow_up), from the first request's record `first` and the
    second request (`follow`, the dataset's follow-up sample; `gen`, its generation or the exception it raised):
    the second reply is the prediction and is scored; the first stays as `response_cot`; the second request's own
    prompt, budget and accounting go under `follow_up`. The first request's fields (its prompt, the compressed
    document's cache) stay on top."""
    def make() -> dict:
        if isinstance(gen, Exception):
            raise gen
        second = sample_record(dataset, follow, follow_ids, budget, gen, query, question_len)
        return {**first, **{k: second[k] for k in ("prediction", "score", "scores")},
                "response_cot": first["prediction"],
                "follow_up": {k: v for k, v in second.items() if k not in SAMPLE_FIELDS}}

    return attempt(sample, make, {"prompt_tokens": first["prompt_tokens"], "budget": first["budget"]})


def write_scores(run_dir: Path, records: list[dict], samples, dataset, dataset_name: str, method_name: str,
                 cfg: DictConfig, spec) -> dict:
    """scores.json over the records of this run's samples (written atomically); returns it."""
    ids_now = {s.id for s in samples}
    finished = [r for r in latest_per_id(records) if r["id"] in ids_now]  # failure records included: n_failed
    summary = {"dataset": dataset_name, "method": method_name, "budget": recorded_budget(cfg), "ratio": cfg.ratio,
               "model": spec.name, "primary_metric": dataset.primary_metric,
               **aggregate(finished, getattr(dataset, "corpus_metrics", None)),
               **dataset.summarize([r for r in finished if not is_failure(r)])}
    write_json_atomic(run_dir / "scores.json", summary)
    return summary
