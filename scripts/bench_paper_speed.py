"""Benchmark (not a test; `make speed-tables`, run by `make gpu-check`): the seed papers' speed and memory tables,
rebuilt on this card with random weights of each paper's model shape (no download), beside the published numbers:

    tailorkv-t4    TailorKV Table 4: decode latency (s/token), Llama-2-7B-32K / Llama-3.1-8B, 16k-96k, batch 1
    tailorkv-t13   TailorKV Table 13: the same for Llama-3.1-8B, Llama-2-7B-32K, Yi-6B-200K, Yi-9B-200K, 16k-128k
    keyformer-t1   Keyformer Table 1: generation tokens/s, MPT-7B-storywriter, full / H2O 90 % / Keyformer 50 %
    pyramidkv-t2   PyramidKV Table 2: KV memory (MiB) and its share of the full cache, Llama-3-8B, 8192 tokens

    python scripts/bench_paper_speed.py --out results/speed-tables                  # GPU: every table (~3 min, H100)
    python scripts/bench_paper_speed.py --table keyformer-t1 --out /tmp/speed        # one table
    python scripts/bench_paper_speed.py --shape tiny --out /tmp/speed                # CPU smoke run (tiny shapes)

Each table writes `<table>.json` and `<table>.md` to --out: every cell as rebuilt / published, with the card, torch
version and date. The published numbers ship with kvbench: `kvbench/report/published/<paper>/speed/<id>.json` (rows
and columns each carry a `run` dict; a cell runs the merge of its row's and its column's; `values` maps column keys
to the printed number, "OOM", or null where the paper prints none).

How each figure is made, and what was reduced to keep the set within a few minutes on one H100:
- decode latency (TailorKV): the official `test_latency.py`'s [T(generate N) - T(generate 2)] / (N - 2) at batch 1,
  N = 2 + --steps (default 10, the paper 20), one repetition (the paper 5, with 30 s pauses), after one prefill per
  (model, length) that the methods share (the paper prefills and compresses in both generations: the difference
  cancels them either way): the full cache decodes the prompt's cache (no copy: what fits is what fits one run) and
  is cut back to the prompt, then one method compresses that cache (a second method prefills again), and both
  generations decode the same compressed cache (after one untimed 2-token warm-up), each 2 tokens longer than the
  last. Decoding is the engine's default eager step (`kvbench.engine.batching.decode`), as a run's. TailorKV in
  its LongBench setting (1 bit, 8 + 56 + 128 tokens, 8 channels; layers {0} for Llama-3.1, {0, 1} for the
  others); PQCache (opt-in: --methods ... pqcache) in its LongBench split with one K-means iteration; OffloadCache
  is not a kvbench method (published only).
- throughput (Keyformer): tokens/s = new / (prefill + new x step), where prefill is the prompt's prefill and
  compression and step the mean decode step over --steps steps, timed at the budget for H2O and Keyformer (their
  cache stays at it: budget = KV % of the prompt) and at the mean cache length prompt + new / 2 for the full cache
  (its cache grows through the generation); the paper decodes all `new` tokens. Greedy at batch 1: the paper says
  beam 4 for every evaluation without restating it for this table, and kvbench decodes MPT at batch 1 only (its
  batch-2 row says so).
- memory (PyramidKV): the compressed KV bytes of one 8192-token prompt (exact, not timed) and their share of the full
  cache's.
Random weights give meaningless text but the real shapes, bytes and kernels. fp16 on CUDA (the papers' dtype),
fp32 on the CPU. A cell that runs out of device memory prints OOM, as the papers do; a cell that fails otherwise
prints its error (logged with its traceback) and the table goes on.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MptConfig

import kvbench.methods  # noqa: F401  (registers every method)
from kvbench.cache.kv_cache import KVCache, KVLayer
from kvbench.engine.batching import decode, generate
from kvbench.engine.generation import Prepared, compress, prefill
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from shapes import LLAMA3_1_8B  # scripts/shapes.py

logger = logging.getLogger("bench_paper_speed")
PUBLISHED = Path(__file__).resolve().parents[1] / "kvbench" / "report" / "published"
TABLES = {"tailorkv-t4": ("tailorkv", "t4"), "tailorkv-t13": ("tailorkv", "t13"),
          "keyformer-t1": ("keyformer", "t1"), "pyramidkv-t2": ("pyramidkv", "t2")}
TABLE_SHAPE = {"keyformer-t1": "mpt-7b-storywriter", "pyramidkv-t2": "llama3-8b"}  # one model per table

_LLAMA2_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=32, vocab_size=32000)
SHAPES = {  # each paper's model configs (random weights); max positions raised to the table's longest prompt
    "llama3.1-8b": dict(LLAMA3_1_8B),
    "llama3-8b": {**{k: v for k, v in LLAMA3_1_8B.items() if k != "rope_scaling"}, "max_position_embeddings": 8192},
    "llama2-7b-32k": {**_LLAMA2_7B, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                      "max_position_embeddings": 131072},  # Llama-2-7B-32K-Instruct (32768 positions; 128k: OOM)
    "yi-6b-200k": {**_LLAMA2_7B, "num_key_value_heads": 4, "vocab_size": 64000, "rope_theta": 5000000.0,
                   "max_position_embeddings": 200000},
    "yi-9b-200k": {**_LLAMA2_7B, "num_hidden_layers": 48, "num_key_value_heads": 4, "vocab_size": 64000,
                   "rope_theta": 10000000.0, "max_position_embeddings": 200000},
    "mpt-7b-storywriter": dict(d_model=4096, n_heads=32, n_layers=32, expansion_ratio=4, max_seq_len=65536,
                               vocab_size=50432),
}
TINY = {  # --shape tiny: every Llama shape becomes this one (3 layers, GQA), MPT a tiny MPT; lengths / 125 or / 16
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, max_position_embeddings=131072),
    "mpt": dict(d_model=128, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=4096, vocab_size=512),
}
QUANT_LAYERS = {"llama3.1-8b": [0]}  # TailorKV's quantization-friendly layers (the paper); {0, 1} for the others


# --- models ----------------------------------------------------------------------------------------------------
class Models:
    """One model on the device at a time (8B weights each), built from its shape with random weights."""

    def __init__(self, device: torch.device, dtype: torch.dtype, tiny: bool):
        self.device, self.dtype, self.tiny = device, dtype, tiny
        self.name, self.model = None, None

    def get(self, shape: str):
        mpt = shape.startswith("mpt")
        name = ("tiny-mpt" if mpt else "tiny-llama") if self.tiny else shape
        if name != self.name:
            self.model = None
            free_device(self.device)
            fields = TINY["mpt" if mpt else "llama"] if self.tiny else SHAPES[shape]
            config = MptConfig(**fields) if mpt else LlamaConfig(**fields)
            torch.manual_seed(0)
            with torch.device(self.device):
                self.model = AutoModelForCausalLM.from_config(
                    config, dtype=self.dtype, attn_implementation="eager" if mpt else "sdpa").eval()
            self.name = name
        return self.model


def free_device(device: torch.device) -> None:
    """Give the last model's or prompt's memory back before the next one (CUDA only: a full collection costs
    seconds in a large process and a CPU has nothing to hand back)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def scaled(n: int, tiny: bool, by: int) -> int:
    return max(n // by, 8) if tiny else n


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_ids(model, n: int, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed + n)
    return torch.randint(0, model.config.vocab_size, (1, n), generator=g).to(device)


def oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


# --- figures -----------------------------------------------------------------------------------------------------
def latency_method(name: str, shape: str):
    """(method, budget) of a TailorKV latency row, or None where kvbench has no such method."""
    if name == "full":
        return METHODS["full"](), None
    if name == "tailorkv":  # the official latency script's LongBench setting
        return METHODS["tailorkv"](bits=1, quant_layers=QUANT_LAYERS.get(shape, [0, 1])), 192
    if name == "pqcache":  # 32 + 32 + 128 at 192; one K-means iteration (the paper's long-context setting)
        return METHODS["pqcache"](kmeans_iters=1), 192
    return None


class Bench:
    def __init__(self, device: torch.device, tiny: bool, steps: int, methods: list[str]):
        self.device, self.tiny, self.steps, self.methods = device, tiny, steps, methods
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        self.models = Models(device, dtype, tiny)
        self.memo: dict = {}  # (figure, run) -> result: a cell shared by two tables is measured once
        self.no_prompt: set = set()  # (shape, n) whose prefill did not fit
        self.held: dict = {}  # (shape, n) -> (cache, logits): the latency tables' current prompt, prefilled once

    def cell(self, figure: str, run: dict):
        key = dict(run)
        if self.tiny:  # every Llama shape is the same tiny model: cells that differ only by that name run once
            tailorkv = run.get("method") == "tailorkv"
            key.update(shape=run["shape"].startswith("mpt"), quant=str(QUANT_LAYERS.get(run["shape"], [0, 1])
                                                                        if tailorkv else None))
        key = (figure, tuple(sorted(key.items())))
        if key not in self.memo:
            try:
                self.memo[key] = getattr(self, figure)(**run)
            except Exception as e:  # noqa: BLE001 - a cell reports its failure, the table goes on
                if not oom(e):
                    logger.exception("bench_paper_speed: %s %s failed", figure, run)
                self.memo[key] = "OOM" if oom(e) else f"error: {type(e).__name__}: {str(e).splitlines()[0][:100]}"
                self.held.clear()
                free_device(self.device)
        return self.memo[key]

    # TailorKV Tables 4 and 13 ------------------------------------------------------------------------------------
    def prompt(self, shape: str, n: int, take: bool = False):
        """(cache, logits) of a random n-token prompt on `shape`, prefilled once and held for the next method at the
        same (shape, n); `take`: the caller consumes the cache (a method compresses it), so it is not held after."""
        key = (shape, n)
        if key in self.no_prompt:  # its prefill ran out of memory once: every method's cell is OOM
            raise torch.OutOfMemoryError(f"the {n}-token prefill of {shape} did not fit")
        if key not in self.held:
            self.held.clear()
            free_device(self.device)
            model = self.models.get(shape)
            try:
                with AttentionCapture(model):
                    cache = KVCache()
                    logits = prefill(model, random_ids(model, n, self.device), cache)
            except Exception as e:
                if oom(e):
                    self.no_prompt.add(key)
                raise
            self.held[key] = (cache, logits)
        return self.held.pop(key) if take else self.held[key]

    def decode_s(self, shape: str, method: str, length: int):
        if latency_method(method, shape) is None:
            return "not implemented"
        if method not in self.methods:
            return "not run"
        n, long = scaled(length, self.tiny, 125), 2 + self.steps
        model = self.models.get(shape)
        m, budget = latency_method(method, shape)
        cache, logits = self.prompt(shape, n, take=method != "full")
        times = []
        with AttentionCapture(model, window=m.query_window) as capture:
            if method != "full":  # compressed once; both generations decode it (the second 2 tokens longer)
                m.prepare(model, None)
                full_bytes = cache.nbytes()
                ledger = compress(m, cache, capture, budget)
            for new in (2, 2, long):  # the first, untimed, meets every kernel and shape once
                prepared = Prepared.from_cache(cache, logits, n, ledger if method != "full" else None,
                                               full_bytes if method != "full" else None)
                sync(self.device)
                times.append(decode(model, None, m, capture, prepared, new, eos_ids=set()).timings["decode_s"])
            times = times[1:]
        if method == "full":  # back to the prompt for the next method, or forgotten if the engine changed it
            if all(type(layer) is KVLayer and layer.keys.shape[-2] >= n for layer in cache.layers):
                for layer in cache.layers:
                    layer.truncate(n)
            else:
                self.held.clear()
                logger.info("bench_paper_speed: %s's cache changed form in decoding; the next method prefills", shape)
        return (times[1] - times[0]) / (long - 2)

    # Keyformer Table 1 ---------------------------------------------------------------------------------------------
    def tok_s(self, shape: str, method: str, kv: float, prompt: int, new: int, batch: int):
        if batch > 1 and shape.startswith("mpt"):  # its attention runs outside transformers' AttentionInterface
            return "batch 1 only (MPT in kvbench)"
        model = self.models.get(shape)
        prompt, new = scaled(prompt, self.tiny, 16), scaled(new, self.tiny, 16)

        def run(length: int):
            m = METHODS[method]()
            budget = None if method == "full" else int(kv * length)
            with AttentionCapture(model, window=m.query_window) as capture:
                sync(self.device)
                return generate(model, None, m, capture, random_ids(model, length, self.device), budget,
                                1 + self.steps, eos_ids=set())

        gen = run(prompt)
        first = gen.timings["prefill_s"] + gen.timings.get("compress_s", 0.0)  # prefill + compression
        if method == "full":  # the full cache grows through the generation: a step at its mean length
            gen = run(prompt + new // 2)
        step = gen.timings["decode_s"] / (len(gen.token_ids) - 1)
        return new / (first + new * step)

    # PyramidKV Table 2 ---------------------------------------------------------------------------------------------
    def kv(self, shape: str, method: str, figure: str, budget: int | None = None):
        model = self.models.get(shape)
        n = scaled(8192, self.tiny, 16)
        budget = scaled(budget, self.tiny, 16) if budget is not None else None
        m = METHODS[method]()
        with AttentionCapture(model, window=m.query_window) as capture:
            gen = generate(model, None, m, capture, random_ids(model, n, self.device), budget, 1, eos_ids=set())
        return {"kv_mib": gen.kv_bytes / 2**20, "kv_ratio": 100 * gen.kv_bytes / gen.full_kv_bytes}[figure]


# --- tables ------------------------------------------------------------------------------------------------------
def load_spec(table: str) -> dict:
    paper, table_id = TABLES[table]
    return json.loads((PUBLISHED / paper / "speed" / f"{table_id}.json").read_text(encoding="utf-8"))


def rebuild(bench: Bench, table: str) -> dict:
    """The table's spec with every cell measured: {row label, group, device, cells: [{column, rebuilt, published,
    run}]}."""
    spec = load_spec(table)
    runs = {(i, j): {**({"shape": TABLE_SHAPE[table]} if table in TABLE_SHAPE else {}), **row["run"], **col["run"]}
            for i, row in enumerate(spec["rows"]) for j, col in enumerate(spec["columns"])
            if row["values"].get(col["key"]) is not None}
    shapes = list(dict.fromkeys(run["shape"] for run in runs.values()))
    # one model at a time, one prompt at a time: the full cache decodes the prompt first, then a method compresses it
    order = sorted(runs, key=lambda ij: (shapes.index(runs[ij]["shape"]), runs[ij].get("length", 0),
                                         runs[ij].get("method") != "full", ij))
    rebuilt = {ij: bench.cell(spec["figure"], runs[ij]) for ij in order}
    rows = []
    for i, row in enumerate(spec["rows"]):
        cells = []
        for j, col in enumerate(spec["columns"]):
            published = row["values"].get(col["key"])
            cells.append({"column": col["label"], "rebuilt": rebuilt.get((i, j), "not printed"),
                          "published": published, "run": runs.get((i, j))})
        rows.append({"group": row["group"], "label": row["label"], "device": row.get("device", spec["device"]),
                     "cells": cells})
    return {"table": table, "paper": spec["paper"], "id": spec["id"], "caption": spec["table"],
            "source": spec["source"], "unit": spec["unit"], "published_device": spec["device"],
            "notes": spec.get("notes", []), "digits": spec["digits"], "rows": rows}


def fmt(value, digits: int) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) else str(value)


def markdown(result: dict) -> str:
    d = result["digits"]
    lines = [f"# {result['caption']}", "",
             f"Rebuilt on {result['card']}, torch {result['torch']}, {result['date']} ({result['shapes']} shapes, "
             f"random weights, {result['dtype']}); published: {result['published_device']}. Each cell: rebuilt / "
             f"published ({result['unit']}).", "", f"Published: {result['source']}", ""]
    cols = [c["column"] for c in result["rows"][0]["cells"]]
    lines += ["| | | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for row in result["rows"]:
        cells = [f"{fmt(c['rebuilt'], d)} / {fmt(c['published'], d)}" if c["published"] is not None else "–"
                 for c in row["cells"]]
        lines.append(f"| {row['group']} | {row['label']} | " + " | ".join(cells) + " |")
    lines += [""] + [f"Note: {n}" for n in result["notes"]] + [f"Reduced: {r}" for r in result["reduced"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", nargs="+", choices=[*TABLES, "all"], default=["all"])
    ap.add_argument("--shape", choices=["paper", "tiny"], default="paper",
                    help="paper: each table's model shape (GPU); tiny: small stand-ins, short prompts (CPU smoke)")
    ap.add_argument("--out", required=True, type=Path, help="folder for <table>.json and <table>.md")
    ap.add_argument("--steps", type=int, default=10, help="decode steps timed per figure (the papers: 18 / all)")
    ap.add_argument("--methods", nargs="+", default=["full", "tailorkv"],
                    help="latency rows to run (pqcache: opt-in, its K-means on 128k prompts is slow)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    device, tiny = torch.device(args.device), args.shape == "tiny"
    if device.type != "cuda" and not tiny:
        raise SystemExit("bench_paper_speed: --shape paper needs a CUDA device (none here); "
                         "use --shape tiny for a CPU smoke run.")
    if args.steps < 1:
        raise SystemExit(f"bench_paper_speed: --steps {args.steps} must be >= 1")
    tables = list(TABLES) if "all" in args.table else list(dict.fromkeys(args.table))
    bench = Bench(device, tiny, args.steps, args.methods)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    reduced = [f"{args.steps} timed decode steps, one repetition", "random weights",
               *(["tiny shapes, prompts / 125 (latency) or / 16 (throughput, memory)"] if tiny else [])]
    args.out.mkdir(parents=True, exist_ok=True)
    written = []
    for table in tables:
        t0 = time.perf_counter()
        result = rebuild(bench, table)
        print(f"{table}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        result.update(card=card, torch=torch.__version__, date=datetime.datetime.now(datetime.timezone.utc)
                      .strftime("%Y-%m-%d %H:%M UTC"), shapes=args.shape, dtype=str(bench.models.dtype)
                      .removeprefix("torch."), steps=args.steps, methods=args.methods, reduced=reduced,
                      seconds=round(time.perf_counter() - t0, 2))
        for suffix, text in ((".json", json.dumps(result, indent=1, ensure_ascii=False) + "\n"),
                             (".md", markdown(result))):
            path = args.out / f"{table}{suffix}"
            path.write_text(text, encoding="utf-8")
            written.append(path)
        print(markdown(result), flush=True)
    return written


if __name__ == "__main__":
    main()
