"""Benchmark (not a test): needle accuracy, KV bytes and decode time per token for several methods and budgets,
relative to the full cache, on the embedded model, all measured in one run.

Each needle prompt is prefilled once (prefill is full attention, identical for every method); each prefill-time
(method, budget) then compresses a copy of that cache and decodes. Decode-time methods (H2O, Keyformer, BUZZ) run
the whole `generate` (their prefill scores depend on the method). `--summary-tokens N` adds a summarisation-style
long generation (N tokens, no stop) over an essay prompt: decode time per token and ROUGE-L against full's text. The NIAH dataset is composed exactly as `python -m kvbench.run`
does for the model (so SmolLM2 gets its answer-prefix specialization).

    python scripts/bench_needle_grid.py --lengths 4000 8000 --depths 0 25 50 75 100 \
        --methods snapkv adakv pyramidkv ada_pyramidkv --budgets 64 128 256

A method may carry settings, `name:key=value,...`, and its own budgets after `@`: `tailorkv:bits=2@192,1024`.
For offloading methods (TailorKV) the table adds host memory and host->device bytes per token from the byte ledger;
"KV bytes" is then what stays on the device, and "+transient" adds the most fetched bytes alive at once in a step.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections import defaultdict

import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

import kvbench.methods  # noqa: F401
from kvbench.cache import KVCache
from kvbench.engine.generation import Prepared, compress, eos_token_ids, prefill
from kvbench.engine.batching import decode, generate
from kvbench.methods.decoding import DecodingMethod
from kvbench.models import AttentionCapture, ModelSpec, load
from kvbench.registry import METHODS
from kvbench.runs.config import CONFIG_DIR


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4000, 8000])
    ap.add_argument("--depths", type=float, nargs="+", default=[0, 25, 50, 75, 100])
    ap.add_argument("--methods", nargs="+", default=["snapkv", "adakv", "pyramidkv", "ada_pyramidkv"])
    ap.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--summary-tokens", type=int, default=0)
    args = ap.parse_args()

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"model={args.model}", f"dataset.context_lengths={args.lengths}",
                                           f"dataset.depth_percents={args.depths}"])
    dataset = instantiate(cfg.dataset)
    model, tok = load(ModelSpec(**cfg.model))
    eos = eos_token_ids(model, tok)
    runs = [("full", None)] + [(m, b) for spec in args.methods for m, budgets in [parse_method(spec, args.budgets)]
                               for b in budgets]
    methods = {name: build_method(name, model, tok, cfg.model) for name in dict.fromkeys(n for n, _ in runs)}
    acc, kv, ms = defaultdict(list), defaultdict(list), defaultdict(list)
    moved = defaultdict(list)  # offloading methods: (host bytes, h2d bytes per token, transient bytes)
    t_start = time.time()
    for sample in dataset.build(tok, cfg.model.max_prompt_tokens):
        ids = torch.tensor([tok(sample.prompt).input_ids])
        length = sample.meta["context_length"]
        with AttentionCapture(model, window=32) as capture:  # 32 covers every method's window
            base = KVCache()
            logits = prefill(model, ids, base)
            queries, scaling = dict(capture.window_queries), dict(capture.scaling)
            for name, budget in runs:
                method = methods[name]
                capture.input_hook = capture.decode_hook = None  # nothing of the previous run stays hooked
                if isinstance(method, DecodingMethod):
                    t0 = time.perf_counter()
                    gen = generate(model, tok, method, capture, ids, budget, sample.max_new_tokens, sample.stop,
                                   eos_ids=eos)
                    key = (length, name, budget)
                    acc[key].append(dataset.score(sample, gen.text)[dataset.primary_metric])
                    kv[key].append(gen.kv_bytes_final)
                    if len(gen.token_ids) > 1:
                        ms[key].append(1000 * gen.timings["decode_s"] / (len(gen.token_ids) - 1))
                    continue
                cache = copy.deepcopy(base)
                capture.window_queries.update(queries)
                capture.scaling.update(scaling)
                ledger = compress(method, cache, capture, budget)
                kv_bytes = cache.nbytes()
                t0 = time.perf_counter()
                gen = decode(model, tok, method, capture, Prepared.from_cache(cache, logits, ids.shape[1], ledger),
                             sample.max_new_tokens, eos, sample.stop)
                text, steps = gen.text, max(len(gen.token_ids) - 1, 0)
                elapsed = time.perf_counter() - t0
                key = (length, name, budget)
                acc[key].append(dataset.score(sample, text)[dataset.primary_metric])
                kv[key].append(kv_bytes)
                if steps:
                    ms[key].append(1000 * elapsed / steps)
                if ledger is not None:
                    summary = ledger.summary()
                    moved[key].append((cache.host_nbytes(), summary["h2d_bytes_per_token"],
                                       summary["transient_device_bytes_max"]))
        print(f"# done {sample.id} ({ids.shape[1]} tokens) after {time.time() - t_start:.0f} s", flush=True)

    print_tables(args, runs, acc, kv, ms, moved)
    if args.summary_tokens:
        summarisation(model, tok, runs, args.summary_tokens)


def summarisation(model, tok, runs, n_tokens: int) -> None:
    """A long generation: a 2k-token essay excerpt, then 'Summarize...'; every method decodes n_tokens (no stop)."""
    from rouge_score import rouge_scorer

    from kvbench.data.niah import essays_dir, read_haystack

    essay = tok.decode(tok(read_haystack(essays_dir())).input_ids[:2000])
    ids = torch.tensor([tok(essay + "\n\nSummarize the essay above in detail, point by point:\n").input_ids])
    scorer = rouge_scorer.RougeScorer(["rougeL"])
    texts, rows = {}, []
    for name, budget in runs:
        method = build_method(name, model, tok)
        window = method.query_window
        with AttentionCapture(model, window=window) as capture:
            gen = generate(model, tok, method, capture, ids, budget, n_tokens, eos_ids=set())
        texts[(name, budget)] = gen.text
        rows.append((name, budget, 1000 * gen.timings["decode_s"] / max(len(gen.token_ids) - 1, 1),
                     gen.kv_bytes_final, gen.text))
    full_text, full_ms, full_kv = texts[("full", None)], rows[0][2], rows[0][3]
    print(f"\n## summarisation-style generation: {ids.shape[1]}-token prompt, {n_tokens} new tokens")
    print("| method | budget | decode ms/tok | vs full | KV bytes at end vs full | ROUGE-L vs full's text |")
    print("|---|---|---|---|---|---|")
    for name, budget, ms_tok, kv_end, text in rows:
        rl = scorer.score(full_text, text)["rougeL"].fmeasure
        print(f"| {name} | {budget or '-'} | {ms_tok:.1f} | {ms_tok / full_ms:.2f} | {kv_end / full_kv:.3f} | {rl:.3f} |")


def parse_method(spec: str, default_budgets: list[int]) -> tuple[str, list[int]]:
    name, _, budgets = spec.partition("@")
    return name, [int(b) for b in budgets.split(",")] if budgets else default_budgets


def build_method(spec: str, model, tok, model_cfg=None):
    """`tailorkv:bits=2,channels=12` -> the configured method; `prepare` runs once (TailorKV's layer split, taken
    from the model config when it lists one, as `configs/method/tailorkv.yaml` does)."""
    name, _, settings = spec.partition(":")
    kwargs = {k: yaml.safe_load(v) for k, v in (s.split("=") for s in settings.split(",") if s)}
    if name == "tailorkv" and model_cfg is not None:
        kwargs.setdefault("quant_layers", model_cfg.get("quant_friendly_layers"))
    method = METHODS[name](**kwargs)
    prepared = method.prepare(model, tok, prefill=prefill)
    if prepared is not None:
        print(f"# {spec}: {prepared}", flush=True)
    return method


def print_tables(args, runs, acc, kv, ms, moved) -> None:
    mib = 2 ** 20
    for length in args.lengths:
        full = (length, "full", None)
        print(f"\n## NIAH context {length} ({len(acc[full])} depths), embedded model, Acc. = 100 x word recall")
        print("(KV bytes: on the device after compression; decode-time methods: at the end of decoding)")
        print("| method | budget | Acc. | KV bytes vs full | +transient vs full | host MiB | H2D MiB/token "
              "| decode ms/tok | decode vs full |")
        print("|---|---|---|---|---|---|---|---|---|")
        full_kv, full_ms = statistics.mean(kv[full]), statistics.median(ms[full])
        for name, budget in runs:
            key = (length, name, budget)
            d = statistics.median(ms[key]) if ms[key] else float("nan")
            host, h2d, transient = (statistics.mean(x) for x in zip(*moved[key])) if moved[key] else (0, 0, 0)
            print(f"| {name} | {budget or '-'} | {100 * statistics.mean(acc[key]):.1f} | "
                  f"{statistics.mean(kv[key]) / full_kv:.4f} | {(statistics.mean(kv[key]) + transient) / full_kv:.4f}"
                  f" | {host / mib:.1f} | {h2d / mib:.2f} | {d:.1f} | {d / full_ms:.2f} |")


if __name__ == "__main__":
    main()
