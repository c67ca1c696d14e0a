"""Golden kept sets from kvpress 0.5.5's wrappers and SimLayerKVPress (tests/fixtures/kvpress_wrappers/goldens.json).

    python scripts/make_kvpress_goldens_wrappers.py --kvpress-python /tmp/kvp/bin/python

The same procedure as scripts/make_kvpress_goldens_new.py (its prompts, model and read-back): kvpress runs in its own
venv as a child of this script, on the embedded SmolLM2-135M-Instruct in fp32 with sdpa; each press prefills each
prompt once, and each layer's and KV head's kept entries are read back by matching every kept key to the
uncompressed key it equals bit for bit. Every case states its kvpress press and ratios, and the kvbench method,
fields and per-layer entry counts (`budgets`) that must keep the same sets. Kept sets are hex bitmasks (bit i =
entry i) per layer and head. This file imports only the standard library at its top, so kvpress's interpreter can
run it.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from kvpress_golden_common import ROOT, golden_parser, load_model, matched_masks, prefill_keys, run_child

OUT = ROOT / "tests/fixtures/kvpress_wrappers/goldens.json"
LAYERS = 30  # the embedded model's
SNAPKV = "SnapKVPress(window_size=64, kernel_size=5)"
SNAPKV_FIELDS = {"window": 64, "kernel": 5, "pooling": "avg"}
LAYER_RATIOS = [0.0] + [(0.25, 0.5, 0.75)[i % 3] for i in range(LAYERS - 1)]  # layer 0 whole, the rest mixed

# name -> (kvpress press, evaluated in the child, with its ratio set; kvbench wrapper spec); ratios: see `budgets`
CASES = {
    "per_layer_snapkv": (f"PerLayerCompressionPress(press={SNAPKV}, compression_ratios={LAYER_RATIOS})",
                         {"method": "snapkv", "fields": SNAPKV_FIELDS, "switches": {"layer_ratios": LAYER_RATIOS}}),
    "chunk_knorm": ("ChunkPress(press=KnormPress(compression_ratio=0.5), chunk_length=64)",
                    {"method": "knorm", "fields": {}, "switches": {"chunk_length": 64}, "ratio": 0.5}),
    "chunk_keydiff": ("ChunkPress(press=KeyDiffPress(compression_ratio=0.5), chunk_length=64)",
                      {"method": "keydiff", "fields": {"block_size": 0}, "switches": {"chunk_length": 64},
                       "ratio": 0.5}),
    "block_knorm": ("BlockPress(press=KnormPress(compression_ratio=0.5), block_size=64)",
                    {"method": "knorm", "fields": {}, "switches": {"block_size": 64}, "ratio": 0.5}),
    "block_keydiff": ("BlockPress(press=KeyDiffPress(compression_ratio=0.5), block_size=64)",
                      {"method": "keydiff", "fields": {"block_size": 0}, "switches": {"block_size": 64},
                       "ratio": 0.5}),
    "compose_snapkv_knorm": (f"ComposedPress([{SNAPKV[:-1]}, compression_ratio=0.5), "
                             "KnormPress(compression_ratio=0.5)])",
                             {"method": "snapkv", "fields": SNAPKV_FIELDS,
                              "switches": {"then": "knorm", "first_ratio": 0.5}, "ratio": [0.5, 0.5]}),
    "simlayerkv_0.85": ("SimLayerKVPress(lazy_threshold=0.85, n_recent=64)",
                        {"method": "simlayerkv", "fields": {"lazy_threshold": 0.85, "reading": "kvpress"},
                         "budget": 64}),
    "simlayerkv_0.55": ("SimLayerKVPress(lazy_threshold=0.55, n_recent=64)",
                        {"method": "simlayerkv", "fields": {"lazy_threshold": 0.55, "reading": "kvpress"},
                         "budget": 64}),
}


def budgets(spec: dict, n: int) -> list[int]:
    """Entries per head each layer keeps in kvbench (the wrappers' `layer_budgets`; SimLayerKV: its lazy count)."""
    if "layer_ratios" in spec.get("switches", {}):
        return [int(n * (1 - r)) for r in spec["switches"]["layer_ratios"]]
    if spec["method"] == "simlayerkv":
        return [4 + spec["budget"] - 1] * LAYERS
    ratios = spec["ratio"] if isinstance(spec["ratio"], list) else [spec["ratio"]]
    for r in ratios:
        n = int(n * (1 - r))
    return [n] * LAYERS


def child(args) -> None:
    """In kvpress's interpreter: kept bitmasks per case and prompt, one JSON document on stdout."""
    import kvpress

    prompts = json.loads(Path(args.ids_file).read_text())
    model = load_model(args.model_dir)
    out = {}
    for ids in prompts:
        full = prefill_keys(model, ids)
        for name, (build, _) in CASES.items():
            kept = prefill_keys(model, ids, eval(build, vars(kvpress)))
            out.setdefault(name, []).append(matched_masks(kept, full, name))
            print(name, len(ids), file=sys.stderr, flush=True)
    print(json.dumps(out))


def main() -> None:
    args = golden_parser(__doc__).parse_args()
    if args.child:
        return child(args)
    prompts = [p["ids"] for p in json.loads((ROOT / "tests/fixtures/kvpress_new/goldens.json").read_text())["prompts"]]
    kept = run_child(__file__, args.kvpress_python, prompts)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "made_by": "scripts/make_kvpress_goldens_wrappers.py (kvpress 0.5.5, transformers 5.2.0, torch CPU, fp32, "
                   "sdpa, the embedded SmolLM2-135M-Instruct; prompts: tests/fixtures/kvpress_new/goldens.json's)",
        "prompts": [{"ids": ids} for ids in prompts],
        "cases": {name: {"press": press, **spec, "budgets": [budgets(spec, len(ids)) for ids in prompts],
                         "kept": kept[name]} for name, (press, spec) in CASES.items()},
    }))
    print(f"wrote {OUT.relative_to(ROOT)}: {len(CASES)} presses x {len(prompts)} prompts")


if __name__ == "__main__":
    main()
