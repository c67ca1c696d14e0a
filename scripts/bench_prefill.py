"""Benchmark (not a test): is one forward over several prompts faster than a forward per prompt? This decides where
batched prefill is worth building (issue 21: "on CPU only where it is faster").

For each length, `--n` prompts of exactly that many tokens (random ids, so no padding: the best case for packing)
are prefilled with the model's own forward and a fresh cache, once as `--n` separate `[1, L]` forwards and once as
one `[n, L]` forward, interleaved over `--reps` rounds; each way reports its best round and the speed-up of packing.

    python scripts/bench_prefill.py [--model embedded] [--lengths 300 1000] [--n 8] [--threads 1] [--device auto]
                                   [--dtype float32]
    python scripts/bench_prefill.py --shape llama3.1-8b --dtype bfloat16 --lengths 1000 4000   # GPU: random weights
"""
from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from kvbench.models import ModelSpec, load
from shapes import LLAMA3_1_8B  # scripts/shapes.py


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--shape", choices=["llama3.1-8b"], help="random weights of this shape instead of --model")
    ap.add_argument("--lengths", type=int, nargs="+", default=[300, 1000])
    ap.add_argument("--n", type=int, default=8, help="prompts per length")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="auto", help="auto: cuda if available")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.shape:  # the real shapes and kernels without a download
        device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA3_1_8B), dtype=getattr(torch, args.dtype),
                                                     attn_implementation="sdpa").eval()
    else:
        model, _ = load(ModelSpec(name="bench", path=args.model, dtype=args.dtype, device=args.device))
    device = next(model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    generator = torch.Generator().manual_seed(0)
    print(f"# {args.shape or args.model} {args.dtype} device={device} threads={torch.get_num_threads()} "
          f"prompts per length={args.n} reps={args.reps}")
    print("| tokens per prompt | one forward per prompt s | one packed forward s | packed speed-up |")
    print("|---|---|---|---|")
    for length in args.lengths:
        ids = torch.randint(100, model.config.vocab_size - 100, (args.n, length), generator=generator).to(device)
        ways = {"alone": lambda: [model(input_ids=ids[i:i + 1], logits_to_keep=1) for i in range(args.n)],
                "packed": lambda: model(input_ids=ids, logits_to_keep=1)}
        best = {name: float("inf") for name in ways}
        with torch.no_grad():
            for rep in range(args.reps + 1):  # round 0 warms up and is not counted
                for name, way in ways.items():
                    sync()
                    t0 = time.perf_counter()
                    way()
                    sync()
                    if rep:
                        best[name] = min(best[name], time.perf_counter() - t0)
        print(f"| {length} | {best['alone']:.2f} | {best['packed']:.2f} | {best['alone'] / best['packed']:.2f}x |")


if __name__ == "__main__":
    main()
