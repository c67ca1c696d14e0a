"""Benchmark (not a test; `make gpu-check` runs it): one table for a model of Llama-3.1-8B's shape with random bf16
weights (no download), per prompt length and method at one budget:

- prefill tokens/s and MFU (model FLOPs: 2 x non-embedding parameters per token + causal attention, over the
  device's dense bf16 peak);
- decode ms/token at batch 1 and its ratio to the bytes-read bound: (weights read per token + KV bytes held) /
  memory bandwidth, the bandwidth measured here with a device-to-device copy (or given with --bandwidth-gbs);
- peak device memory of the method's batch-1 run (CUDA);
- first, per length, plain transformers' `generate` with its full cache: the baseline of the batch-1 decode step;
- batched decode tokens/s at batch 1/8/32 (`kvbench.engine.batching`, after one more prefill), every sample decoding from
  a copy of the same compressed cache (decode-time eviction and storage methods hold per-sample hooks and are
  skipped there; a batch whose caches do not fit in free memory says so).

    python scripts/bench_gpu.py                                   # GPU: 32k/64k/128k, budget 2048
    python scripts/bench_gpu.py --shape tiny                      # smoke run on a CPU (fp32, short prompts)

Random weights give meaningless text but the real shapes, bytes and kernels. No figure from this script has been
measured on a GPU by kvbench's authors yet; the CPU smoke run only checks that it works.
"""
from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import kvbench.methods  # noqa: F401
from kvbench.attention.decode import without_cudnn_attention
from kvbench.engine.batching import PrefilledOnce, Request, generate
from kvbench.methods.base import Kind
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from shapes import LLAMA3_1_8B  # scripts/shapes.py

SHAPES = {  # Llama-3.1-8B-Instruct's config (rope scaling included), and a tiny stand-in for CPU smoke runs
    "llama3.1-8b": LLAMA3_1_8B,
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=131072),
}
DEFAULTS = {  # per shape: dtype, lengths, budget, batch sizes, new tokens
    "llama3.1-8b": (torch.bfloat16, [32768, 65536, 131072], 2048, [1, 8, 32], 32),
    "tiny": (torch.float32, [512, 1024], 128, [1, 8, 32], 8),
}
PEAK_TFLOPS = {"H200": 989.0, "H100 SXM": 989.0, "H100 80GB HBM3": 989.0, "H100 PCIe": 756.0, "H100": 989.0,
               "A100": 312.0, "L40S": 362.0}  # dense bf16, no sparsity


def measured_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    n = (1 << 30) if device.type == "cuda" else (1 << 26)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    t0, reps = time.perf_counter(), 10
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * n * reps / (time.perf_counter() - t0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_flops(device: torch.device, override: float | None) -> float | None:
    if override:
        return override * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v * 1e12 for k, v in PEAK_TFLOPS.items() if k in name), None)


def weight_bytes_read(model) -> int:
    """Parameter bytes a decode step reads: everything but the embedding table (one row per token), the LM head
    counted once even when tied to the embeddings."""
    embed = model.get_input_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    tied = model.get_output_embeddings().weight is embed
    return total - (0 if tied else embed.numel() * embed.element_size())


def prefill_flops(config, n: int, params_non_embedding: int) -> float:
    head_dim = config.hidden_size // config.num_attention_heads
    attention = 2 * n * n * head_dim * config.num_attention_heads * config.num_hidden_layers  # QK^T + PV, causal
    return 2 * params_non_embedding * n + attention


def decode_run(model, method, capture, ids, budget, batch, copies_of, new_tokens, memo) -> float:
    """Decode tokens/s of `batch` samples decoding together from copies of one prefilled prompt."""
    decoder = PrefilledOnce(model, None, method, capture, batch, eos_ids=set(), memo=memo)
    requests = [Request(ids, budget, new_tokens, tag=copies_of) for _ in range(batch)]
    sync(ids.device)
    t0 = time.perf_counter()
    gens = [g for _, g in decoder.run(requests)]
    sync(ids.device)
    seconds = time.perf_counter() - t0 - decoder.join_s
    return sum(len(g.token_ids) - 1 for g in gens) / seconds


def transformers_decode(model, ids, new_tokens: int, device) -> tuple[float, float]:
    """Plain transformers: greedy `generate` with its own full cache, as the baseline of kvbench's batch-1 step (both
    launch-bound on a GPU at batch 1). Run without cuDNN attention like kvbench's decode steps (with it, every step
    is a new shape and a new cuDNN graph). Returns (prefill s, decode s per token): one generate of 1 token, one of
    `new_tokens`, the difference over the extra steps."""
    seconds = []
    with without_cudnn_attention():
        for n in (1, new_tokens):
            sync(device)
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            sync(device)
            seconds.append(time.perf_counter() - t0)
    return seconds[0], (seconds[1] - seconds[0]) / (new_tokens - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3.1-8b")
    ap.add_argument("--lengths", type=int, nargs="+")
    ap.add_argument("--budget", type=int)
    ap.add_argument("--methods", nargs="+", default=["full", "streamingllm", "snapkv", "pyramidkv", "adakv"])
    ap.add_argument("--batches", type=int, nargs="+")
    ap.add_argument("--new-tokens", type=int)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--peak-tflops", type=float, help="dense bf16 peak of the device, if not in the table")
    ap.add_argument("--bandwidth-gbs", type=float, help="memory bandwidth for the bound, instead of measuring it")
    args = ap.parse_args()
    dtype, lengths, budget, batches, new_tokens = DEFAULTS[args.shape]
    lengths, budget = args.lengths or lengths, args.budget or budget
    batches, new_tokens = args.batches or batches, args.new_tokens or new_tokens
    device = torch.device(args.device)
    if device.type != "cuda" and args.shape != "tiny":
        raise SystemExit(f"bench_gpu: --shape {args.shape} needs a CUDA device (none here); "
                         "use --shape tiny for a CPU smoke run.")

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPES[args.shape]), dtype=dtype,
                                                 attn_implementation="sdpa").eval()
    bandwidth = args.bandwidth_gbs * 1e9 if args.bandwidth_gbs else measured_bandwidth(device)
    warm = torch.randint(0, model.config.vocab_size, (1, 512), device=device)  # CUDA context, kernels, allocator:
    with AttentionCapture(model) as capture:  # out of the first row (its prefill read 7-17 % slower on the H100)
        generate(model, None, METHODS["snapkv"](), capture, warm, 128, 4, eos_ids=set())
    peak = peak_flops(device, args.peak_tflops)
    weights = weight_bytes_read(model)
    embed = model.get_input_embeddings().weight
    non_embedding = sum(p.numel() for p in model.parameters()) - embed.numel()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# {args.shape} {str(dtype).removeprefix('torch.')} on {name}: weights read/token "
          f"{weights / 2**20:.1f} MiB, bandwidth {bandwidth / 1e9:.0f} GB/s "
          f"({'given' if args.bandwidth_gbs else 'measured copy'}), peak "
          f"{f'{peak / 1e12:.0f} TFLOPS' if peak else 'unknown (MFU n/a)'}, budget {budget}, {new_tokens} new tokens")
    print("| prompt | method | prefill tok/s | MFU | decode ms/tok | bound ms/tok | ratio | peak mem GiB | "
          + " | ".join(f"batch {b} tok/s" for b in batches) + " |")
    print("|---|---|---|---|---|---|---|---|" + "---|" * len(batches))
    for n in lengths:
        ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
        ids = ids.to(device)
        prefill_s, decode_s = transformers_decode(model, ids, new_tokens, device)
        print(f"| {n} | transformers generate | {n / prefill_s:.0f} | n/a | {1000 * decode_s:.2f} | n/a | n/a | n/a | "
              + " | ".join("n/a" for _ in batches) + " |", flush=True)
        for method_name in args.methods:
            method = METHODS[method_name]()
            method_budget = None if method_name == "full" else budget
            window = method.query_window
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            cells = []
            with AttentionCapture(model, window=window) as capture:  # batch 1 exactly as a run does it
                sync(device)
                gen = generate(model, None, method, capture, ids, method_budget, new_tokens, eos_ids=set())
                sync(device)
            steps = len(gen.token_ids) - 1
            decode_s = gen.timings["decode_s"] / max(steps, 1)
            bound_s = (weights + (gen.kv_bytes + gen.kv_bytes_final) / 2) / bandwidth
            prefill_tok_s = n / gen.timings["prefill_s"]
            mfu = prefill_flops(model.config, n, non_embedding) / gen.timings["prefill_s"] / peak if peak else None
            peak_mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
            memo: dict = {}  # batched: one more prefill, then every sample decodes from a copy of that cache
            with AttentionCapture(model, window=window) as capture:
                for batch in batches:
                    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
                    if getattr(method, "evicts_while_decoding", False) or method.kind is Kind.STORAGE:
                        cells.append("n/a")
                    elif free is not None and (batch + 1) * gen.kv_bytes_final * 1.2 > free:
                        cells.append("no memory")
                    else:
                        tok_s = decode_run(model, method, capture, ids, method_budget, batch, 0, new_tokens, memo)
                        cells.append(f"{tok_s:.1f}")
                memo.clear()
            print(f"| {n} | {method_name} | {prefill_tok_s:.0f} | {f'{100 * mfu:.1f}%' if mfu else 'n/a'} | "
                  f"{1000 * decode_s:.2f} | {1000 * bound_s:.2f} | {decode_s / bound_s:.2f} | "
                  f"{f'{peak_mem:.1f}' if peak_mem is not None else 'n/a'} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
