"""Golden merged values from kvpress 0.5.5's MergingPress (tests/fixtures/kvpress_merging/goldens.json).

    python scripts/make_kvpress_goldens_merging.py --kvpress-python /tmp/kvp/bin/python

The procedure of scripts/make_kvpress_goldens_wrappers.py (kvpress in its own venv as a child of this script, the
embedded SmolLM2-135M-Instruct in fp32 with sdpa, kept entries read back by matching every kept key bit for bit to
the uncompressed key: MergingPress keeps keys unchanged), on the first golden prompt of
tests/fixtures/kvpress_new/goldens.json. For each case, layer and KV head: the kept set (hex bitmask, bit i = entry
i) and, in the layers `VALUE_LAYERS`, each kept entry's merged value, in position order, projected on cos(j) for
channel j (one number per entry keeps the file small; a value folded into the wrong entry, or with the wrong weight,
moves it). This file imports only the standard library at its top, so kvpress's interpreter can run it.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from kvpress_golden_common import ROOT, golden_parser, load_model, matched_positions, run_child

OUT = ROOT / "tests/fixtures/kvpress_merging/goldens.json"
VALUE_LAYERS = (0, 1, 15, 29)  # the embedded model has 30
SNAPKV = "SnapKVPress(window_size=64, kernel_size=5, compression_ratio=0.5)"

# name -> (kvpress press, evaluated in the child; kvbench method, its fields and the merge switches), ratio 0.5
CASES = {
    "knorm": ("MergingPress(press=KnormPress(compression_ratio=0.5))",
              {"method": "knorm", "fields": {}, "switches": {"merge": True}}),
    "snapkv": (f"MergingPress(press={SNAPKV})",
               {"method": "snapkv", "fields": {"window": 64, "kernel": 5, "pooling": "avg"},
                "switches": {"merge": True}}),
    "knorm_gated": ("MergingPress(press=KnormPress(compression_ratio=0.5), similarity_threshold=0.3, "
                    "merge_fraction=0.75)",
                    {"method": "knorm", "fields": {},
                     "switches": {"merge": True, "merge_threshold": 0.3, "merge_fraction": 0.75}}),
}


def prefill(model, ids, press=None):
    """Each layer's (keys, values), `[H, n', D]` each, after prefilling `ids` under `press` if given."""
    from contextlib import nullcontext

    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad(), (press(model) if press is not None else nullcontext()):
        model(torch.tensor([ids]), past_key_values=cache, logits_to_keep=1)
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers]


def projected(values) -> list[float]:
    """Each row of `values` [k, D] projected on PROBE, to 7 significant digits."""
    import torch

    probe = torch.cos(torch.arange(values.shape[-1], dtype=torch.float64))
    return [float(f"{x:.7g}") for x in (values.double() @ probe).tolist()]


def child(args) -> None:
    """In kvpress's interpreter: per case, layer and head, the kept mask and the kept merged values' projections."""
    import kvpress

    ids = json.loads(Path(args.ids_file).read_text())[0]
    model = load_model(args.model_dir)
    full = prefill(model, ids)
    out = {}
    for name, (build, _) in CASES.items():
        layers = []
        pressed = prefill(model, ids, eval(build, vars(kvpress)))
        for i, ((keys, values), (full_keys, _)) in enumerate(zip(pressed, full)):
            heads = []
            for h in range(keys.shape[0]):
                positions = matched_positions(keys[h], full_keys[h], name)
                heads.append({"kept": hex(sum(1 << p for p in positions))})
                if i in VALUE_LAYERS:
                    order = sorted(range(len(positions)), key=positions.__getitem__)
                    heads[-1]["merged"] = projected(values[h][order])
            layers.append(heads)
        out[name] = layers
        print(name, file=sys.stderr, flush=True)
    print(json.dumps(out))


def main() -> None:
    args = golden_parser(__doc__).parse_args()
    if args.child:
        return child(args)
    ids = json.loads((ROOT / "tests/fixtures/kvpress_new/goldens.json").read_text())["prompts"][0]["ids"]
    got = run_child(__file__, args.kvpress_python, [ids])
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "made_by": "scripts/make_kvpress_goldens_merging.py (kvpress 0.5.5, transformers 5.2.0, torch CPU, fp32, "
                   "sdpa, the embedded SmolLM2-135M-Instruct; prompt: tests/fixtures/kvpress_new/goldens.json's first)",
        "probe": "cos(j), j = 0..head_dim-1",
        "ids": ids,
        "ratio": 0.5,
        "value_layers": list(VALUE_LAYERS),
        "cases": {name: {"press": press, **spec, "layers": got[name]} for name, (press, spec) in CASES.items()},
    }))
    print(f"wrote {OUT.relative_to(ROOT)}: {len(CASES)} presses x 1 prompt")


if __name__ == "__main__":
    main()
