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

from kvpress_golden_common import ROOT, embedded_model_dir, golden_parser, load_model, run_child, unmasked_masks

OUT = ROOT / "tests/fixtures/kvpress_fastkvzip/goldens.json"
CASES = [(0.25, False), (0.5, False), (0.5, True)]  # (compression_ratio, layerwise)
SEED = 0


def child(args) -> None:
    """In kvpress's interpreter: one JSON document of cases on stdout."""
    import kvpress
    import torch
    from kvpress.presses.fastkvzip_press import FastKVzipGate
    from safetensors.torch import load_file
    from transformers import DynamicCache

    prompts = json.loads(Path(args.ids_file).read_text())
    model = load_model(args.model_dir)
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
            kept = unmasked_masks(attention, n, n_kv)
            cases.append({"prompt": p, "ratio": ratio, "layerwise": layerwise, "near": near, "kept": kept})
    print(json.dumps(cases))


def main() -> None:
    ap = golden_parser(__doc__)
    ap.add_argument("--gates", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    model_dir = embedded_model_dir()  # (puts this checkout's kvbench on the path)
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from kvbench.methods.fastkvzip import random_gates

    config = AutoConfig.from_pretrained(model_dir)
    prompts = json.loads((ROOT / "tests/fixtures/kvpress/prompts.json").read_text())["ids"]
    with tempfile.TemporaryDirectory() as tmp:
        gates = Path(tmp) / "gates.safetensors"
        save_file({f"layers.{i}.{name}": t.contiguous() for i, layer in enumerate(random_gates(config, SEED))
                   for name, t in layer.items()}, str(gates))
        cases = run_child(__file__, args.kvpress_python, prompts, "--gates", str(gates), model_dir=model_dir)
    version = subprocess.run([args.kvpress_python, "-c", "import importlib.metadata as m, transformers, torch; "
                              "print(m.version('kvpress'), transformers.__version__, torch.__version__)"],
                             check=True, capture_output=True, text=True).stdout.split()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "made_by": f"scripts/make_kvpress_goldens_fastkvzip.py: kvpress {version[0]}, transformers {version[1]}, "
                   f"torch {version[2]}, fp32, sdpa, {model_dir.name}",
        "prompts": "tests/fixtures/kvpress/prompts.json",
        "press": f"FastKVzipPress(compression_ratio, layerwise) with gates = kvbench random_gates(config, seed={SEED})",
        "cases": cases}, separators=(",", ":")) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}: {len(cases)} cases, "
          f"{sum(len(c['near']) for c in cases)} near-tie entries")


if __name__ == "__main__":
    sys.exit(main())
