"""Golden masked sets from kvpress 0.5.5's FastKVzipPress (tests/fixtures/kvpress_fastkvzip/goldens.json).

    PYTHONPATH=. python scripts/make_kvpress_goldens_fastkvzip.py --kvpress-python /tmp/kvp/bin/python

kvpress needs transformers < 5.3, so it runs in its own venv as a child of this script, on the embedded
SmolLM2-135M-Instruct converted folder (fp32, sdpa) and the two prompts of tests/fixtures/kvpress/prompts.json (192
and 256 tokens). No published gate exists for this model and kvbench unpickles none, so both sides get the same
seeded random gate: this script writes kvbench's `fastkvzip.random_gates` (seed 0) to a safetensors file, and the
child loads it into kvpress's own `FastKVzipGate` modules (`press.gates`, so that nothing is downloaded). Each case
runs `with press(model): model(ids, past_key_values=DynamicCache())`; FastKVzipPress masks instead of removing: the
kept set of each layer and KV head is every entry not in the module's `masked_key_indices`. Cases: ratios 0.25 and
0.5 (`layerwise=False`, one top-k over all layers) and 0.5 with `layerwise=True`. Entries whose score lies within
1e-6 (relative) of the cut are recorded as near ties, which the test lets differ. Masks: one hex integer per head,
bit i = entry i kept. This file imports only the standard library at its top, so kvpress's interpreter can run it.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests/fixtures/kvpress_fastkvzip/goldens.json"
MODEL = Path.home() / ".cache/kvbench/models/SmolLM2-135M-Instruct.Q4_1-v0.1.2"
CASES = [(0.25, False), (0.5, False), (0.5, True)]  # (compression_ratio, layerwise)
SEED = 0


def child(args) -> None:
    """In kvpress's interpreter: one JSON document of cases on stdout."""
    import kvpress
    import torch
    from kvpress.presses.fastkvzip_press import FastKVzipGate
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(2)
    prompts = json.loads((ROOT / "tests/fixtures/kvpress/prompts.json").read_text())["ids"]
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="sdpa")
    config, tensors = model.config, load_file(args.gates)
    n_kv = config.num_key_value_heads
    gates = []
    for i in range(config.num_hidden_layers):
        gate = FastKVzipGate(i, config.hidden_size, n_kv, config.num_attention_heads // n_kv, torch.float32)
        gate.load_state_dict({name.split(".", 2)[2]: t for name, t in tensors.items()
                              if name.startswith(f"layers.{i}.")})
        gates.append(gate.eval())
    attention = [layer.self_attn for layer in model.model.layers]
    cases = []
    for p, ids in enumerate(prompts):
        n = len(ids)
        for ratio, layerwise in CASES:
            press = kvpress.FastKVzipPress(compression_ratio=ratio, layerwise=layerwise)
            press.gates = gates
            near, original_post = [], press.compress_post

            def compress_post(model_, press=press, near=near, ratio=ratio, layerwise=layerwise):
                scores = torch.stack(press.score_val)[:, 0]  # [L, H, n]
                groups = scores.flatten(1) if layerwise else scores.flatten()[None]
                for g, flat in enumerate(groups):
                    cut = flat.sort().values[int(flat.numel() * ratio)]  # the lowest kept score
                    block = scores[g] if layerwise else scores
                    for idx in ((block - cut).abs() <= 1e-6 * cut.abs()).nonzero().tolist():
                        near.append([g, *idx] if layerwise else idx)
                return original_post(model_)

            press.compress_post = compress_post
            with torch.no_grad(), press(model):
                model(torch.tensor([ids]), past_key_values=DynamicCache())
            kept = []
            for module in attention:
                heads = [set(range(n)) for _ in range(n_kv)]
                for h, i in zip(module.masked_key_indices[1].tolist(), module.masked_key_indices[2].tolist()):
                    heads[h].discard(i)
                kept.append([hex(sum(1 << i for i in head)) for head in heads])
                module.masked_key_indices = None
            cases.append({"prompt": p, "ratio": ratio, "layerwise": layerwise, "near": near, "kept": kept})
    print(json.dumps(cases))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kvpress-python", default="/tmp/kvp/bin/python")
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--model-dir", default=str(MODEL))
    parser.add_argument("--gates")
    args = parser.parse_args()
    if args.child:
        return child(args)
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from kvbench.methods.fastkvzip import random_gates

    config = AutoConfig.from_pretrained(args.model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        gates = Path(tmp) / "gates.safetensors"
        save_file({f"layers.{i}.{name}": t.contiguous() for i, layer in enumerate(random_gates(config, SEED))
                   for name, t in layer.items()}, str(gates))
        done = subprocess.run([args.kvpress_python, __file__, "--child", "--model-dir", args.model_dir,
                               "--gates", str(gates)], check=True, capture_output=True, text=True)
    cases = json.loads(done.stdout.strip().splitlines()[-1])
    version = subprocess.run([args.kvpress_python, "-c", "import importlib.metadata as m, transformers, torch; "
                              "print(m.version('kvpress'), transformers.__version__, torch.__version__)"],
                             check=True, capture_output=True, text=True).stdout.split()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "made_by": f"scripts/make_kvpress_goldens_fastkvzip.py: kvpress {version[0]}, transformers {version[1]}, "
                   f"torch {version[2]}, fp32, sdpa, {Path(args.model_dir).name}",
        "prompts": "tests/fixtures/kvpress/prompts.json",
        "press": f"FastKVzipPress(compression_ratio, layerwise) with gates = kvbench random_gates(config, seed={SEED})",
        "cases": cases}, separators=(",", ":")) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}: {len(cases)} cases, "
          f"{sum(len(c['near']) for c in cases)} near-tie entries")


if __name__ == "__main__":
    sys.exit(main())
