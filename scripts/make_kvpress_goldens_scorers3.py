"""Golden kept sets from kvpress 0.5.5 for KVComposePress and KVgradPress (tests/fixtures/kvpress_scorers3/).

    python scripts/make_kvpress_goldens_scorers3.py --kvpress-python /tmp/kvp/bin/python

The pattern of scripts/make_kvpress_goldens_new.py: kvpress (transformers < 5.3) runs in its own venv as a child of
this script, on the same token ids and converted weights (the embedded SmolLM2-135M-Instruct, fp32), called as
kvpress's pipeline calls it (`model.model(input_ids=context, past_key_values=cache)` inside the press). Kept sets
are hex bitmasks (bit i = entry i) per layer and KV head.
- KVComposePress (structured) removes entries: each kept key is matched bit for bit to the key of a run without the
  press, run eagerly as the press runs (it switches the model to eager attention for its two forwards).
- KVComposePress(structured=False) and KVgradPress mask entries: the kept set is the complement of each module's
  `masked_key_indices`. KVgradPress reads the tokenizer from `model.config.name_or_path`: a copy without the chat
  template is used (no prefix: the replay starts at position 0, kvbench's `sinks=repeated`).
A budget B per head is asked as the ratio that makes the press keep B x (layers: structured; layers x heads: the
others) of its N scored entries: int(N (1 - ratio)) kept (KVComposePress), or int(N ratio) pruned (KVgradPress,
KVzip's rule).
This file imports only the standard library at its top, so kvpress's interpreter can run it.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from kvpress_golden_common import (ROOT, embedded_model_dir, golden_parser, load_model, matched_masks, needle_prompts,
                                   run_child, tokenizer_without_template, unmasked_masks)

OUT = ROOT / "tests/fixtures/kvpress_scorers3/goldens.json"
PROMPTS = [(160, 48), (240, 96)]  # (prompt tokens, budget per KV head)

# name -> (kvbench method, its fields, the press as kvpress builds it, attention, masks, per-B unit: "layers"|"heads",
#          the count the press takes from the ratio: "kept" | "pruned")
CASES = {
    "kvcompose": ("kvcompose", {}, "KVComposePress()", "eager", False, "layers", "kept"),
    "kvcompose_unstructured": ("kvcompose", {"structured": False}, "KVComposePress(structured=False)", "eager",
                               True, "heads", "kept"),
    "kvgrad": ("kvgrad", {"sinks": "repeated"}, "KVgradPress()", "sdpa", True, "heads", "pruned"),
}


def child(args) -> None:
    """In kvpress's interpreter: kept bitmasks per case and prompt, one JSON document on stdout."""
    import torch
    import kvpress
    from transformers import DynamicCache

    prompts = json.loads(Path(args.ids_file).read_text())
    models = {attn: load_model(args.model_dir, attn) for attn in ("eager", "sdpa")}
    for model in models.values():
        model.config.name_or_path = args.tokenizer_dir  # KVgradPress reads its tokenizer from here
    out = {}
    for p, ids in enumerate(prompts):
        n, budget = len(ids), PROMPTS[p][1]
        for name, (_, _, build, attn, masks, unit, count) in CASES.items():
            if name not in args.cases.split(","):
                continue
            model = models[attn]
            layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
            entries = layers * (heads if unit == "heads" else 1)
            press = eval(build, vars(kvpress))
            total, numel = budget * entries, n * entries
            press.compression_ratio = 1 - (total + (0.5 if count == "kept" else -0.5)) / numel
            cache, full = DynamicCache(), DynamicCache()
            with torch.no_grad():
                model.model(input_ids=torch.tensor([ids]), past_key_values=full)
            with press(model):
                with torch.no_grad():
                    model.model(input_ids=torch.tensor([ids]), past_key_values=cache)
            if masks:
                kept = unmasked_masks([layer.self_attn for layer in model.model.layers], n, heads)
            else:
                kept = matched_masks([layer.keys[0] for layer in cache.layers],
                                     [layer.keys[0] for layer in full.layers], name)
            out.setdefault(name, []).append(kept)
            print(name, p, file=sys.stderr, flush=True)
    print(json.dumps(out))


def main() -> None:
    ap = golden_parser(__doc__)
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated cases to (re)make; others are kept")
    ap.add_argument("--tokenizer-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    prompts = needle_prompts([n for n, _ in PROMPTS])
    model_dir = embedded_model_dir()
    with tempfile.TemporaryDirectory() as tmp:  # the tokenizer without its chat template (KVgradPress: no prefix)
        no_template = tokenizer_without_template(model_dir, Path(tmp) / "tokenizer")
        kept = run_child(__file__, args.kvpress_python, prompts, "--tokenizer-dir", str(no_template),
                         "--cases", args.cases, model_dir=model_dir)
    earlier = json.loads(OUT.read_text())["cases"] if OUT.exists() else {}
    kept = {**{name: case["kept"] for name, case in earlier.items() if name not in kept}, **kept}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "made_by": "scripts/make_kvpress_goldens_scorers3.py (kvpress 0.5.5, transformers 5.2.0, torch CPU, fp32, "
                   "the embedded SmolLM2-135M-Instruct)",
        "prompts": [{"ids": ids, "budget": b} for ids, (_, b) in zip(prompts, PROMPTS)],
        "cases": {name: {"method": m, "fields": f, "press": press, "kept": kept[name]}
                  for name, (m, f, press, *_) in CASES.items() if name in kept},
    }))
    print(f"wrote {OUT.relative_to(ROOT)}: {len(kept)} presses x {len(prompts)} prompts")


if __name__ == "__main__":
    main()
