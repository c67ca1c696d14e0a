"""kvpress's leaderboard rows (nvidia/kvpress-leaderboard) from run directories, with the published numbers beside.

    python -m kvbench.report.leaderboard results/leaderboard --out results/report/leaderboard

One row per run (a method at a compression ratio on one model and RULER length), in kvpress's leaderboard schema
(`SCHEMA`: dataset, data_dir, model, method, compression_ratio, score) followed by kvbench's own columns
(`KVBENCH_COLUMNS`): `query_aware` (the question compressed with the context: the leaderboard's second loop,
kvpress's `--query_aware`; false: the grid's question-agnostic runs), the score's standard error, the samples and
tasks behind it, the KV bytes held after compression and their fraction of the full cache, the bits per stored
code and the bytes per kept entry (kvbench.report.bits: one memory axis for quantized and evicting runs), and the mean
time per sample. `score` is kvpress's: each task's
string match (RULER's metric: string_match_part for qa_*, string_match_all otherwise; x 100, 2 decimals, as
`evaluation/benchmarks/ruler/calculate_metrics.py`), averaged over the tasks (the leaderboard's average). `method`
is kvpress's press name (`no_press`, `streaming_llm`, `observed_attention`, ...), and a run counts only when its
method ran with the settings that name stands for (`KVPRESS`); a run with other settings is left out, with a warning
naming the setting. Written: `leaderboard.csv` and `leaderboard.jsonl` (the rows), `leaderboard.md` (the rows with
the published score beside each, `kvbench/report/published/kvpress_leaderboard.json`).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import pandas as pd
import yaml

from kvbench.data.ruler.templates import task_metric
from kvbench.metrics.ruler import postprocess, string_match_all, string_match_part, task_score
from kvbench.metrics.stats import combine_se, mean_se
from kvbench.report.bits import kv_bits
from kvbench.report.escape import md_row
from kvbench.report.records import is_failure, latest_per_id
from kvbench.report.runs import PREDICTIONS, find_run_dirs, load_run, read_manifest, read_predictions

logger = logging.getLogger(__name__)

SCHEMA = ("dataset", "data_dir", "model", "method", "compression_ratio", "score")
KVBENCH_COLUMNS = ("query_aware", "score_se", "n_samples", "n_failed", "n_tasks", "kv_bytes", "kv_fraction",
                   "bits", "bytes_per_entry", "time_s", "prefill_s", "compress_s", "question_s", "decode_s", "run_dir")
PUBLISHED = Path(__file__).parent / "published" / "kvpress_leaderboard.json"
SAMPLE_METRIC = {"string_match_all": string_match_all, "string_match_part": string_match_part}

# kvbench method -> (kvpress press name in evaluate_registry.py, the method settings that make it that press)
KVPRESS = {
    "full": ("no_press", {}),
    "random": ("random", {}),
    "knorm": ("knorm", {"recent": 0}),
    "snapkv": ("snapkv", {"window": 64, "kernel": 5, "pooling": "avg"}),
    "streamingllm": ("streaming_llm", {"n_sink": 4, "recent": None}),
    "tova": ("tova", {"keep_last": True, "prefill_only": True}),
    "h2o": ("observed_attention", {"variant": "prefill_only", "recent_size": 0, "normalize": "observed"}),
    "pyramidkv": ("pyramidkv", {"schedule": "kvpress", "window": 64, "kernel": 5, "pooling": "avg", "beta": 20}),
    "lagkv": ("lagkv", {"n_sink": 4, "lag_size": 128}),
    "keydiff": ("keydiff", {"block_size": 0}),
    "cur": ("cur", {}),
    "kvzip": ("kvzip", {"sinks": "repeated", "chunk_size": 2048}),
    # the query-aware loop's (query=aware)
    "adakv": ("adakv_snapkv", {"window": 64, "kernel": 5, "pooling": "avg", "alpha": 0.2, "allocation": "kvpress"}),
    "chunkkv": ("chunkkv", {"window": 64, "kernel": 5, "pooling": "avg", "chunk_length": 20, "entropy_gate": False}),
}


def press_name(method: str, settings: dict) -> tuple[str | None, str | None]:
    """(kvpress's press name, None), or (None, why the run is not that press)."""
    if method not in KVPRESS:
        return None, f"{method} has no kvpress leaderboard press (kvbench has: {', '.join(KVPRESS)})"
    name, needed = KVPRESS[method]
    wrong = [f"method.{k}={settings.get(k)!r} (kvpress: {v!r})" for k, v in needed.items() if settings.get(k) != v]
    return (None, f"{method} ran with {', '.join(wrong)}") if wrong else (name, None)


def bytes_per_entry(df: pd.DataFrame) -> float | None:
    """The run's KV bytes over the entries it kept (kvbench.report.bits), or None where records lack them."""
    if "kv_entries" not in df or "kv_bytes" not in df or not df["kv_entries"].notna().any():
        return None
    entries = df["kv_entries"].sum()
    return float(df["kv_bytes"].sum() / entries) if entries else None


def run_row(run_dir: Path) -> dict | None:
    """One run directory's leaderboard row, or None (not a RULER run, no records, or not a kvpress press)."""
    df = load_run(run_dir)
    if df.empty or "meta.task" not in df:
        return None
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8")) or {}
    method = df["method"].iloc[0]
    name, why = press_name(method, cfg.get("method") or {})
    if name is None:
        logger.warning("leaderboard: %s left out: %s", run_dir, why)
        return None
    lengths = sorted(set(df["meta.length"].astype(int)))
    if len(lengths) != 1:
        logger.warning("leaderboard: %s left out: %d RULER lengths in one run; a row is one length", run_dir,
                       len(lengths))
        return None
    scores, ses = [], []
    for task, g in df.groupby("meta.task", sort=True):
        preds = [postprocess(str(p)) for p in g["prediction"]]
        refs = [list(r) for r in g["references"]]
        scores.append(task_score(task_metric(task), preds, refs))
        ses.append(mean_se(SAMPLE_METRIC[task_metric(task)](p, r) for p, r in zip(preds, refs)).scaled(100).se)
    failed = sum(map(is_failure, latest_per_id(read_predictions(run_dir / PREDICTIONS))))
    model = cfg.get("model") or {}
    path = str(model.get("path") or "")
    mean = lambda col: float(df[col].mean()) if col in df and df[col].notna().any() else None  # noqa: E731
    kv, full = mean("kv_bytes"), mean("full_kv_bytes")
    return {"dataset": "ruler", "data_dir": str(lengths[0]),
            "model": path if "/" in path and not Path(path).exists() else df["model"].iloc[0],
            "method": name, "compression_ratio": 0.0 if method == "full" else float(df["ratio"].iloc[0]),
            "score": round(sum(scores) / len(scores), 2),
            "score_se": combine_se(ses, [1 / len(ses)] * len(ses)), "n_samples": len(df), "n_failed": failed,
            "n_tasks": len(scores),
            "kv_bytes": kv, "kv_fraction": kv / full if kv is not None and full else None,
            "bits": kv_bits(cfg), "bytes_per_entry": bytes_per_entry(df),
            "time_s": mean("e2e_s"), "prefill_s": mean("prefill_s"), "compress_s": mean("compress_s"),
            "question_s": mean("question_s"), "decode_s": mean("decode_s"), "run_dir": str(run_dir)}


def leaderboard(paths) -> pd.DataFrame:
    """The rows of every leaderboard run under `paths`, sorted by model, length, query mode, method and ratio; runs
    of other datasets are skipped. `query_aware`: the question was compressed with the context (the leaderboard's
    second loop, kvpress's --query_aware), else the context alone (its grid)."""
    rows = []
    for run_dir in find_run_dirs(paths):
        manifest = read_manifest(run_dir)
        if manifest.get("dataset") != "ruler":  # another benchmark's run in the same tree
            continue
        row = run_row(run_dir)
        if row is not None:
            rows.append({**row, "query_aware": manifest.get("query", "aware") == "aware"})
    out = pd.DataFrame(rows, columns=[*SCHEMA, *KVBENCH_COLUMNS])
    first = out["method"] != "no_press"  # the full cache first, then the presses by name
    return out.assign(_first=first).sort_values(["model", "data_dir", "query_aware", "_first", "method",
                                                 "compression_ratio"],
                                                kind="stable").drop(columns="_first").reset_index(drop=True)


def load_published() -> dict:
    return json.loads(PUBLISHED.read_text(encoding="utf-8"))


def published_score(published: dict, row: dict) -> tuple[float | None, str | None]:
    """The published score of a row's (model, data_dir, method, compression_ratio) and its source's name (a number
    printed as such before one read off a plot, which is marked ≈)."""
    found = [e for e in published["rows"] if (e["model"], e["data_dir"], e["method"], e.get("query_aware", False))
             == (row["model"], row["data_dir"], row["method"], bool(row.get("query_aware", False)))
             and abs(e["compression_ratio"] - row["compression_ratio"]) < 1e-9]
    for entry in sorted(found, key=lambda e: e.get("digitized", False)):
        return entry["score"], ("≈ " if entry.get("digitized") else "") + entry["source"]
    return None, None


def markdown(rows: pd.DataFrame, published: dict) -> str:
    """The rows as a Markdown table, the published score and its source beside each, then the sources."""
    head = ["model", "data_dir", "method", "query", "compression_ratio", "score ± se", "published", "KV bytes", "KV %",
            "bits", "B / entry", "s / sample", "n (failed)"]
    lines = [md_row(head), md_row(["---"] * len(head))]
    for _, r in rows.iterrows():
        pub, source = published_score(published, r)
        se = "" if r["score_se"] is None or pd.isna(r["score_se"]) else f" ± {r['score_se']:.2f}"
        lines.append(md_row([r["model"], r["data_dir"], r["method"], "aware" if r["query_aware"] else "agnostic",
                             f"{r['compression_ratio']:g}",
                             f"{r['score']:.2f}{se}", "–" if pub is None else f"{pub:.2f} ({source})",
                             "–" if pd.isna(r["kv_bytes"]) else f"{r['kv_bytes']:.0f}",
                             "–" if pd.isna(r["kv_fraction"]) else f"{100 * r['kv_fraction']:.1f}",
                             "–" if pd.isna(r["bits"]) else f"{r['bits']:.0f}",
                             "–" if pd.isna(r["bytes_per_entry"]) else f"{r['bytes_per_entry']:.1f}",
                             "–" if pd.isna(r["time_s"]) else f"{r['time_s']:.2f}",
                             f"{r['n_samples']}" + (f" ({r['n_failed']} failed)" if r["n_failed"] else "")]))
    lines += ["", "score: RULER's string match per task (x 100), averaged over the tasks; ± its standard error over "
              "the samples. KV bytes: held after compression, the question's entries included; s / sample: prefill + "
              "compression + question + decoding. Failed samples are left out of every mean.", "",
              "Published (kvpress leaderboard protocol, RULER 4k; question-agnostic unless marked):"]
    lines += [f"- {s['name']}: {s['url']}" + (f" ({s['note']})" if s.get("note") else "")
              for s in published["sources"]]
    return "\n".join(lines) + "\n"


def write(rows: pd.DataFrame, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    published = load_published()
    files = [out / "leaderboard.csv", out / "leaderboard.jsonl", out / "leaderboard.md"]
    rows.to_csv(files[0], index=False)
    files[1].write_text("".join(json.dumps({k: (None if pd.isna(v) else v) if not isinstance(v, str) else v
                                            for k, v in r.items()}) + "\n" for r in rows.to_dict("records")),
                        encoding="utf-8")
    files[2].write_text(markdown(rows, published), encoding="utf-8")
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbench.report.leaderboard",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="run directories or folders holding them")
    parser.add_argument("--out", required=True, help="folder for leaderboard.{csv,jsonl,md}")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        rows = leaderboard(args.paths)
    except (ValueError, FileNotFoundError) as e:
        print(f"kvbench: {e}", file=sys.stderr)
        return 2
    if rows.empty:
        print(f"kvbench: leaderboard: no RULER run of a kvpress press under {' '.join(args.paths)}; "
              "run `make leaderboard` (or leaderboard-smoke) first", file=sys.stderr)
        return 2
    for f in write(rows, Path(args.out)):
        print(f"wrote {f}")
    print(markdown(rows, load_published()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
