"""`python -m kvbench.methods.tailorkv_layers`: TailorKV's layer split for any model, printed (see the package).

A command, so it sits on the top floor with the other `python -m` entries: it loads the model and hands the
identification the engine's prefill."""
from __future__ import annotations

import argparse
from pathlib import Path

from kvbench.engine.generation import prefill
from kvbench.methods import tailorkv_layers
from kvbench.methods.tailorkv_layers import identify_with_calibration
from kvbench.models.loader import ModelSpec, load


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvbench.methods.tailorkv_layers",
                                     description=tailorkv_layers.__doc__.split("\n")[0])
    parser.add_argument("--model", default="embedded", help="embedded | <local dir> | <file.gguf> | random:<family>")
    parser.add_argument("--calibration", help="local GSM8K train .jsonl/.parquet (default: the self-written stand-in)")
    parser.add_argument("--last-q", type=int, default=32)
    parser.add_argument("--alpha", type=float, default=0.05)
    parser.add_argument("--tau", type=float, default=0.2)
    parser.add_argument("--causal", action="store_true", help="mask keys later than each query (not the reference)")
    parser.add_argument("--dtype", default="float32", help="the reference ran fp16 on GPU")
    parser.add_argument("--device", default="auto")
    args = parser.parse_args(argv)

    name = "smollm2-135m-instruct" if args.model == "embedded" else Path(args.model).stem.replace(":", "-")
    model, tokenizer = load(ModelSpec(name=name, path=args.model, dtype=args.dtype, device=args.device))
    result = identify_with_calibration(model, tokenizer, args.calibration, last_q=args.last_q, alpha=args.alpha,
                                       tau=args.tau, causal=args.causal, prefill=prefill)

    print(f"calibration: {args.calibration or 'self-written stand-in (not GSM8K)'}; last_q={args.last_q} "
          f"alpha={args.alpha} tau={args.tau} causal={args.causal}")
    print("layer  score   kind")
    for i, score in enumerate(result.scores):
        print(f"{i:<5}  {score:.4f}  {result.label(i)}")
    print(f"quant_layers: {result.quant_layers}  prompt_tokens: {result.prompt_len}")


if __name__ == "__main__":
    main()
