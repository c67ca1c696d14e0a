"""Benchmark (not a test): KV held at peak when each layer is compressed inside the prefill forward
(`compress_after=layer`, the default) vs after the whole prefill (`compress_after=prefill`), on the embedded model.

Per method: `peak_kv_bytes / (compressed cache + one full layer)` (goal <= 1.05 with `layer`), and the process's
peak RSS growth over the prompt's run. Each figure is its own fresh process (the peak RSS of a process never goes
down, and a second method in one process reuses memory the first freed), after a warm-up generation; `--reps` runs
every (method, order) that many times, the orders alternating, and the table gives the median and the spread
(min-max): one run is not a figure on a shared machine.

The children run with glibc's mmap threshold fixed (`MALLOC_MMAP_THRESHOLD_`, 128 KiB): by default glibc raises the
threshold each time a large block is freed, after which blocks of that size come from the heap and stay in the
process's RSS when freed, so the same run read 151 or 432 MiB of growth by chance (SnapKV, 4k, 3 processes). With
the threshold fixed every large tensor is its own mapping, returned when freed, and the growth is the live memory's:
the same figure in every process. `--glibc-default` measures without it (what a user's process sees).

`--kvpress-python <python of a venv with kvpress 0.5.5 and transformers 5.2>` adds kvpress's SnapKVPress on the same
token ids, model weights and ratio (1 - budget / prompt length), prefill plus the same new tokens greedily, each
run in a fresh process of that interpreter under the same allocator setting: kvpress needs transformers < 5.3, so it
never shares kvbench's environment.

    python scripts/bench_memory.py [--length 4096] [--budget 128] [--reps 3] [--methods snapkv pyramidkv adakv ...]
                                   [--orders prefill layer] [--floor] [--kvpress-python /tmp/kvp/bin/python]
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MMAP_THRESHOLD = 128 * 1024  # glibc's default starting threshold, kept fixed (see the docstring)


def rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


class RssMeter:
    """Peak RSS over a block of code, two ways. `growth`: the peak over the block minus the RSS when it started
    (Linux: the high-water mark is reset at the start through /proc/self/clear_refs, then read from VmHWM), what
    the block itself needed. `lifetime_growth`: how much the block raised the process's lifetime peak
    (`ru_maxrss`, the earlier figure), which hides whatever part of the block's peak stayed under an earlier one
    (the model load's, the warm-up's): it depends on what the process did before. Before the block starts, freed
    heap memory goes back to the system (`malloc_trim`): small blocks freed earlier (building the prompt, loading)
    would otherwise stay resident and serve the block's small allocations unseen, 0-6 MiB by the process's history
    (kvbench's child read 89 or 95 MiB by whether it built the prompt itself or read it from a file)."""

    def __enter__(self) -> "RssMeter":
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass
        self.lifetime_before = rss_peak()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        self.start = self._status("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        peak = self._status("VmHWM")
        self.growth = peak - self.start
        self.lifetime_growth = max(peak, self.lifetime_before) - self.lifetime_before

    @staticmethod
    def _status(field: str) -> int:
        line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field + ":"))
        return int(line.split()[1]) * 1024  # kB


def child(order: str, name: str, args) -> None:
    """Run `name` once with `order` after a warm-up, printing one JSON line."""
    import kvbench.methods  # noqa: F401
    from kvbench.data.niah import NeedleHaystack
    from kvbench.engine.batching import generate
    from kvbench.models import AttentionCapture, ModelSpec, load
    from kvbench.registry import METHODS

    import torch

    model, tok = load(ModelSpec(name="bench", path="embedded"))
    sample = NeedleHaystack(context_lengths=[args.length + 165], depth_percents=[50]).build(tok, 100_000)[0]
    ids = torch.tensor([tok(sample.prompt).input_ids])
    with AttentionCapture(model) as capture:  # warm-up on a short prompt: one-time allocations out of the figure
        generate(model, tok, METHODS["full"](), capture, ids[:, :64], None, 2, eos_ids=set())
    if name == "plain":  # transformers' own forward of the prompt, no cache, no capture: the floor
        with RssMeter() as meter, torch.no_grad():
            model(ids, use_cache=False, logits_to_keep=1)
        print(json.dumps({"method": "transformers forward, no cache", "order": "-", "prompt_tokens": ids.shape[1],
                          "rss_growth": meter.growth, "lifetime_growth": meter.lifetime_growth}), flush=True)
        return
    method = METHODS[name]()
    with RssMeter() as meter, AttentionCapture(model, window=method.query_window) as capture:
        gen = generate(model, tok, method, capture, ids, args.budget, args.new_tokens, eos_ids=set(),
                       compress_after=order)
    bound = gen.kv_bytes + gen.full_kv_bytes / model.config.num_hidden_layers
    print(json.dumps({"method": name, "order": order, "prompt_tokens": ids.shape[1], "peak_kv": gen.peak_kv_bytes,
                      "kv": gen.kv_bytes, "full_kv": gen.full_kv_bytes, "ratio": gen.peak_kv_bytes / bound,
                      "rss_growth": meter.growth, "lifetime_growth": meter.lifetime_growth,
                      "prefill_s": gen.timings["prefill_s"]}), flush=True)


def kvpress_child(args) -> None:
    """In kvpress's interpreter: SnapKVPress over the ids kvbench wrote, one JSON line (this file imports only the
    standard library at its top, so that interpreter can run it)."""
    import torch
    from kvpress import SnapKVPress
    from transformers import AutoModelForCausalLM, DynamicCache

    ids = torch.tensor([json.loads(Path(args.ids_file).read_text())])
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        model(ids[:, :64], past_key_values=DynamicCache())  # warm-up, as kvbench's child
        meter = RssMeter().__enter__()
        cache = DynamicCache()
        with SnapKVPress(compression_ratio=1 - args.budget / ids.shape[1])(model):
            logits = model(ids, past_key_values=cache, logits_to_keep=1).logits[:, -1]  # (kvpress's pipeline
            # prefills through the base model: no logits for the context, as kvbench's prefill)
        for t in range(args.new_tokens - 1):
            token = logits.argmax(-1, keepdim=True)
            logits = model(token, past_key_values=cache, position_ids=torch.tensor([[ids.shape[1] + t]])).logits[:, -1]
        meter.__exit__()
    kv = sum(layer.keys.numel() * 2 * layer.keys.element_size() for layer in cache.layers)
    print(json.dumps({"method": "kvpress SnapKVPress", "order": "in forward", "prompt_tokens": ids.shape[1],
                      "rss_growth": meter.growth,
                      "lifetime_growth": meter.lifetime_growth, "kv_after": kv}), flush=True)


def prompt_ids(args) -> tuple[str, str]:
    """The bench's prompt as token ids in a file, and the embedded model's folder, for kvpress's interpreter."""
    from kvbench.data.niah import NeedleHaystack
    from kvbench.models.embedded import embedded_model_dir
    from kvbench.models import ModelSpec, load

    _, tok = load(ModelSpec(name="bench", path="embedded"))
    sample = NeedleHaystack(context_lengths=[args.length + 165], depth_percents=[50]).build(tok, 100_000)[0]
    path = Path(tempfile.mkdtemp()) / "ids.json"
    path.write_text(json.dumps(tok(sample.prompt).input_ids))
    return str(path), str(embedded_model_dir())


def kvpress_run(args, ids_file: str, model_dir: str) -> dict:
    cmd = [args.kvpress_python, __file__, "--kvpress-child", "--ids-file", ids_file, "--model-dir", model_dir,
           "--budget", str(args.budget), "--new-tokens", str(args.new_tokens)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if not args.glibc_default:
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode:
        sys.exit(f"bench_memory: kvpress ({args.kvpress_python}) failed:\n{out.stderr[-3000:]}")
    return next(json.loads(line) for line in out.stdout.splitlines() if line.startswith("{"))


def one_run(order: str, name: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", order, name, "--length", str(args.length), "--budget",
           str(args.budget), "--new-tokens", str(args.new_tokens)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}  # this checkout's kvbench
    if not args.glibc_default:
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if out.returncode:
        sys.exit(f"bench_memory: {name} ({order}) failed:\n{out.stderr[-3000:]}")
    return next(json.loads(line) for line in out.stdout.splitlines() if line.startswith("{"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3, help="fresh processes per (method, order), orders alternating")
    ap.add_argument("--methods", nargs="+", default=["snapkv", "pyramidkv", "adakv", "streamingllm"])
    ap.add_argument("--glibc-default", action="store_true", help="keep glibc's dynamic mmap threshold (RSS then "
                    "depends on the allocator's history, not only on what is alive)")
    ap.add_argument("--kvpress-python", help="a Python with kvpress 0.5.5 (and transformers 5.2): its SnapKVPress "
                    "beside kvbench's, same ids and ratio, fresh processes")
    ap.add_argument("--orders", nargs="+", default=["prefill", "layer"], choices=["prefill", "layer"])
    ap.add_argument("--floor", action="store_true", help="add transformers' own forward of the prompt (no cache, "
                    "no capture) in a fresh process per rep: what the model's activations alone take")
    ap.add_argument("--child", nargs=2, metavar=("ORDER", "METHOD"))
    ap.add_argument("--kvpress-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ids-file", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(*args.child, args)
    if args.kvpress_child:
        return kvpress_child(args)

    runs: dict[tuple[str, str], list[dict]] = {}
    ids_file, model_dir = prompt_ids(args) if args.kvpress_python else (None, None)
    for rep in range(args.reps):
        for order in args.orders if rep % 2 == 0 else args.orders[::-1]:
            for name in args.methods:
                runs.setdefault((name, order), []).append(one_run(order, name, args))
        if args.kvpress_python:
            runs.setdefault(("kvpress SnapKVPress", "in forward"), []).append(kvpress_run(args, ids_file, model_dir))
        if args.floor:
            runs.setdefault(("transformers forward, no cache", "-"), []).append(one_run("-", "plain", args))
    mib = 2**20
    first = next(r[0] for r in runs.values() if "full_kv" in r[0])
    print(f"## peak KV at {first['prompt_tokens']} prompt tokens, budget {args.budget} (embedded SmolLM2, "
          f"full cache {first['full_kv'] / mib:.1f} MiB); RSS: median [min-max] of {args.reps} fresh processes, "
          f"{'glibc default' if args.glibc_default else f'mmap threshold fixed at {MMAP_THRESHOLD // 1024} KiB'}")
    print("| method | order | compressed MiB | peak KV MiB | peak / (compressed + one layer) | peak RSS growth MiB "
          "| lifetime peak growth MiB |")
    print("|---|---|---|---|---|---|---|")
    median: dict[str, dict] = {"rss_growth": {}, "lifetime_growth": {}}
    for (name, order), rows in runs.items():
        cells = []
        for key in median:
            growth = sorted(r[key] / mib for r in rows)
            median[key][(name, order)] = statistics.median(growth)
            cells.append(f"{median[key][(name, order)]:.0f} [{growth[0]:.0f}-{growth[-1]:.0f}]")
        r = rows[0]  # (the KV figures are exact: the same in every rep)
        kv = [f"{r['kv'] / mib:.2f}", f"{r['peak_kv'] / mib:.2f}", f"{r['ratio']:.3f}"] if "kv" in r else \
            [f"{r['kv_after'] / mib:.2f}" if "kv_after" in r else "–", "–", "–"]
        print(f"| {name} | {order} | {' | '.join(kv)} | {' | '.join(cells)} |")
    ratios = [r["ratio"] for (_, order), rows in runs.items() if order == "layer" for r in rows]
    if ratios:
        print(f"\nlayer order: worst peak / (compressed + one layer) = {max(ratios):.3f} (goal <= 1.05)")
    if args.kvpress_python and ("snapkv", "layer") in median["rss_growth"]:
        for key, what in (("rss_growth", "peak RSS growth"), ("lifetime_growth", "lifetime peak growth")):
            ratio = median[key][("snapkv", "layer")] / median[key][("kvpress SnapKVPress", "in forward")]
            print(f"{what}, kvbench SnapKV (layer) / kvpress SnapKVPress: {ratio:.2f}x (goal <= 0.8x)")

if __name__ == "__main__":
    main()
