"""Benchmark (not a test; `make gpu-check` runs it): the static decode step against its goals (issue 33), one card.

For a model of Llama-3.1-8B's shape with random bf16 weights (no download), budget 2048:
- the peer row: plain transformers with its `StaticCache` and a `torch.compile(mode="reduce-overhead")` decode step
  (CUDA graphs), full cache, batch 1: what a user of transformers alone reaches;
- batch 1 at each length, `step=captured` (kvbench.engine.static: the step recorded into a CUDA graph): decode ms/token
  and its ratio to the bytes-read bound ((weights + K/V held) / bandwidth, the bandwidth measured by a device copy);
  goal <= 1.5x for full, snapkv, pyramidkv, adakv, h2o, and kvbench's full cache <= 1.1x the peer row;
- batch 32 at the first length, every row decoding from a copy of one compressed cache: tokens/s, goal >= 2,000 for
  snapkv, pyramidkv, adakv, h2o, and Ada-KV within 1.2x of SnapKV; `step=eager` beside it (today's engine).

    python scripts/bench_static.py --out results/static            # GPU: 32k and 64k
    python scripts/bench_static.py --shape tiny --out /tmp/static    # CPU smoke run (fp32, short prompts, no graphs)

Every figure goes to `<out>/static.json` and `<out>/static.md` (card, torch version, date). On the CPU `captured`
runs dynamo's eager backend (the capture without code generation): the figures there only show that it runs.
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, StaticCache

import kvbench.methods  # noqa: F401
from kvbench.engine.batching import BatchedDecoder, PrefilledOnce, Request
from kvbench.engine.generation import prepare
from kvbench.engine.static import StaticDecoder
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from bench_gpu import SHAPES, measured_bandwidth, sync, weight_bytes_read  # scripts/bench_gpu.py

DEFAULTS = {"llama3.1-8b": (torch.bfloat16, [32768, 65536], 2048, 32, 32),  # dtype, lengths, budget, batch, new
            "tiny": (torch.float32, [512, 1024], 128, 8, 8)}
BATCH_1 = ("full", "snapkv", "pyramidkv", "adakv", "h2o")
BATCHED = ("snapkv", "pyramidkv", "adakv", "h2o")


class StaticPrefilledOnce(PrefilledOnce, StaticDecoder):
    """The static step over copies of one prefilled, compressed prompt (as `PrefilledOnce` does for the eager one)."""


def peer_ms_per_token(model, ids, new_tokens: int, compile_backend: str | None) -> float:
    """Plain transformers: `StaticCache` of prompt + new tokens, prefill, then a compiled one-token step."""
    n, device = ids.shape[1], ids.device
    torch._dynamo.reset()  # (each measurement compiles afresh: the model's frames would pile up cache entries)
    cache = StaticCache(config=model.config, max_cache_len=n + new_tokens + 1)
    with torch.no_grad():
        logits = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]

        def step(token, position):
            out = model(token, position_ids=position[None], cache_position=position, past_key_values=cache,
                        use_cache=True)
            return out.logits[:, -1].argmax(dim=-1, keepdim=True)

        kwargs = {"backend": compile_backend} if compile_backend else {"mode": "reduce-overhead"}
        step = torch.compile(step, fullgraph=True, **kwargs)
        token = logits.argmax(dim=-1, keepdim=True)
        times = []
        for t in range(new_tokens):
            position = torch.tensor([n + t], device=device)
            sync(device)
            t0 = time.perf_counter()
            token = step(token, position).clone()
            sync(device)
            times.append(time.perf_counter() - t0)
    steady = times[len(times) // 2:]  # after compilation and the graphs' recording
    return 1000 * sorted(steady)[len(steady) // 2]


def batch_one(model, method_name, ids, budget, new_tokens, step) -> tuple[float, int]:
    """(decode ms/token, mean K/V bytes held) of one prompt through the static step (or the eager engine)."""
    method = METHODS[method_name]()
    budget = None if method_name == "full" else budget
    torch._dynamo.reset()
    with AttentionCapture(model, window=method.query_window) as capture:
        kind = BatchedDecoder if step == "eager" else StaticDecoder
        extra = {} if step == "eager" else {"compile": step == "captured",
                                            "backend": None if ids.is_cuda else "eager"}
        decoder = kind(model, None, method, capture, 1, eos_ids=set(), **extra)
        (_, gen), = decoder.run([Request(ids, budget, new_tokens)])
    if isinstance(gen, Exception):
        raise gen
    return 1000 * steady(decoder.step_seconds), int(gen.kv_bytes_decode_mean)


def steady(seconds: list[float]) -> float:
    """The median step of the second half: after compilation, the graph's recording and the allocator's growth."""
    half = sorted(seconds[len(seconds) // 2:])
    return half[len(half) // 2]


def batched_tok_s(model, method_name, ids, budget, batch, new_tokens, step) -> float:
    """Tokens/s of `batch` rows decoding together from copies of one compressed prompt."""
    method = METHODS[method_name]()
    torch._dynamo.reset()
    with AttentionCapture(model, window=method.query_window) as capture:
        kind = PrefilledOnce if step == "eager" else StaticPrefilledOnce
        extra = {} if step == "eager" else {"compile": step == "captured",
                                            "backend": None if ids.is_cuda else "eager"}
        decoder = kind(model, None, method, capture, batch, eos_ids=set(), memo={}, **extra)
        requests = [Request(ids, budget, new_tokens, tag="prompt") for _ in range(batch)]
        sync(ids.device)
        t0 = time.perf_counter()
        gens = [g for _, g in decoder.run(requests)]
        sync(ids.device)
        seconds = time.perf_counter() - t0 - decoder.join_s
    failed = [g for g in gens if isinstance(g, Exception)]
    if failed:
        raise failed[0]
    if step != "eager":  # every row decodes each step: the steady step's rate
        return batch / steady(decoder.step_seconds)
    return sum(len(g.token_ids) - 1 for g in gens) / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(DEFAULTS), default="llama3.1-8b")
    ap.add_argument("--lengths", type=int, nargs="+")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--bandwidth-gbs", type=float, help="memory bandwidth for the bound, instead of measuring it")
    args = ap.parse_args()
    dtype, lengths, budget, batch, new_tokens = DEFAULTS[args.shape]
    lengths = args.lengths or lengths
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and args.shape != "tiny":
        raise SystemExit("bench_static: --shape llama3.1-8b needs a CUDA device; use --shape tiny on a CPU")
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPES[args.shape]), dtype=dtype,
                                                 attn_implementation="sdpa").eval()
    bandwidth = args.bandwidth_gbs * 1e9 if args.bandwidth_gbs else measured_bandwidth(device)
    weights = weight_bytes_read(model)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows, lines = [], []

    def record(**row) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)

    for n in lengths:
        ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n)).to(device)
        peer = peer_ms_per_token(model, ids, new_tokens, None if device.type == "cuda" else "eager")
        full_bound = 1000 * (weights + 2 * n * model.config.num_hidden_layers * model.config.num_key_value_heads
                             * (model.config.hidden_size // model.config.num_attention_heads) * ids.new_empty(
                                 0, dtype=dtype).element_size()) / bandwidth
        record(prompt=n, batch=1, method="transformers StaticCache + compile", step="captured", ms_per_token=peer,
               bound_ms=full_bound, ratio=peer / full_bound)
        for name in BATCH_1:
            ms, held = batch_one(model, name, ids, budget, new_tokens, "captured")
            bound = 1000 * (weights + held) / bandwidth
            goal = "<= 1.5x bound" + (f", <= 1.1x peer ({ms / peer:.2f}x)" if name == "full" else "")
            record(prompt=n, batch=1, method=name, step="captured", ms_per_token=ms, bound_ms=bound,
                   ratio=ms / bound, goal=goal, met=ms / bound <= 1.5 and (name != "full" or ms / peer <= 1.1))
    n = lengths[0]
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n)).to(device)
    tok_s = {}
    for name in BATCHED:
        for step in ("captured", "eager"):
            tok_s[name, step] = batched_tok_s(model, name, ids, budget, batch, new_tokens, step)
            record(prompt=n, batch=batch, method=name, step=step, tok_s=tok_s[name, step],
                   goal=">= 2000 tok/s" if step == "captured" else "today's engine",
                   met=tok_s[name, step] >= 2000 if step == "captured" else None)
    ada = tok_s["snapkv", "captured"] / tok_s["adakv", "captured"]
    record(prompt=n, batch=batch, method="adakv vs snapkv", step="captured", slowdown=ada, goal="<= 1.2x",
           met=ada <= 1.2)
    header = (f"# static step, {args.shape} {str(dtype).removeprefix('torch.')} on {card}, torch {torch.__version__}, "
              f"{datetime.now(timezone.utc):%Y-%m-%d}: bandwidth {bandwidth / 1e9:.0f} GB/s, budget {budget}, "
              f"{new_tokens} new tokens")
    lines = [header, "", "| prompt | batch | method | step | ms/token | bound ms | ratio | tok/s | goal | met |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        cells = [row.get("prompt"), row.get("batch"), row["method"], row["step"], row.get("ms_per_token"),
                 row.get("bound_ms"), row.get("ratio", row.get("slowdown")), row.get("tok_s"), row.get("goal", ""),
                 row.get("met", "")]
        lines.append("| " + " | ".join(f"{c:.2f}" if isinstance(c, float) else str("" if c is None else c)
                                        for c in cells) + " |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "static.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    (args.out / "static.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
