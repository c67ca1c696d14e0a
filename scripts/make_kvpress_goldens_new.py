"""Golden kept sets from kvpress 0.5.5 for the methods issue 35 adds (tests/fixtures/kvpress_new/goldens.json).

    python scripts/make_kvpress_goldens_new.py --kvpress-python /tmp/kvp/bin/python

kvpress needs transformers < 5.3, so it runs in its own venv (`pip install kvpress==0.5.5 transformers==5.2.0`),
as a child of this script on the same token ids and the same converted weights (the embedded SmolLM2-135M-Instruct
in fp32, sdpa). For each press it prefills the prompt once under the press and once without, and reads back which
entries each layer and KV head kept by matching every kept key to the uncompressed key it equals bit for bit (the
layers after a compressed one see the same hidden states: kvpress compresses after each layer's attention).
A budget B per KV head is asked of kvpress as compression_ratio = 1 - (B + 0.5) / n, so that its int(n (1 - ratio))
is B (ChunkKVPress: int(chunks (1 - ratio)) = B / chunk_length, B a multiple of it). CriticalAdaKVPress masks
entries instead of removing them: its kept set is every entry not in the module's `masked_key_indices`.
LeverageScorePress draws its sketch from torch's global generator: the child seeds it with seed + layer right
before each layer's attention, which is kvbench's per-layer generator. Kept sets are stored as hex bitmasks (bit i =
entry i) per layer and head.
This file imports only the standard library at its top, so kvpress's interpreter can run it.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from kvpress_golden_common import (ROOT, golden_parser, load_model, matched_masks, needle_prompts, prefill_keys,
                                   run_child, seed_each_layer, unmasked_masks)

OUT = ROOT / "tests/fixtures/kvpress_new/goldens.json"
PROMPTS = [(280, 100), (400, 120)]  # (prompt tokens, budget per KV head): multiples of 20 (ChunkKV's chunks)
SEED = 0

# name -> (kvbench method, its fields, the press as kvpress builds it: evaluated in the child)
CASES = {
    "random": ("random", {"seed": SEED}, f"RandomPress(seed={SEED})"),
    "keydiff": ("keydiff", {}, "BlockPress(press=KeyDiffPress(), block_size=128)"),
    "keydiff_oneshot": ("keydiff", {"block_size": 0}, "KeyDiffPress()"),
    "lagkv": ("lagkv", {"n_sink": 4}, "LagKVPress()"),
    "cur": ("cur", {}, "CURPress()"),
    "leverage_score": ("leverage_score", {"seed": SEED}, "LeverageScorePress()"),
    "chunkkv": ("chunkkv", {}, "ChunkKVPress(press=SnapKVPress(), chunk_length=20)"),
    "chunkkv_entropy": ("chunkkv", {"entropy_gate": True, "chunk_length": 10},
                        "EntropyGatedChunkKVPress(press=SnapKVPress(), chunk_length=10)"),
    "non_causal_attn": ("non_causal_attn", {}, "NonCausalAttnPress()"),
    "critical_kv": ("critical_kv", {}, "CriticalKVPress(press=SnapKVPress())"),
    "critical_adakv": ("critical_adakv", {}, "CriticalAdaKVPress(press=SnapKVPress())"),
}
MASKING = {"critical_adakv"}  # kvpress masks these (module.masked_key_indices) instead of removing entries


def ratio_for(press: str, n: int, budget: int) -> float:
    return 1 - (budget + 0.5) / n


def child(args) -> None:
    """In kvpress's interpreter: kept bitmasks per case and prompt, one JSON document on stdout."""
    import kvpress

    prompts = json.loads(Path(args.ids_file).read_text())
    model = load_model(args.model_dir)
    attention = [layer.self_attn for layer in model.model.layers]
    hooks = seed_each_layer(model, SEED)  # LeverageScorePress's sketch
    out = {}
    for p, ids in enumerate(prompts):
        full = prefill_keys(model, ids)
        for name, (_, _, build) in CASES.items():
            press = eval(build, vars(kvpress))
            press.compression_ratio = ratio_for(build, len(ids), PROMPTS[p][1])
            kept = prefill_keys(model, ids, press)
            if name in MASKING:  # kept = every entry the press did not mask, per layer and head
                out.setdefault(name, []).append(unmasked_masks(attention, len(ids), full[0].shape[0]))
                continue
            out.setdefault(name, []).append(matched_masks(kept, full, name))
            print(name, p, file=sys.stderr, flush=True)
    for h in hooks:
        h.remove()
    print(json.dumps(out))


def main() -> None:
    args = golden_parser(__doc__).parse_args()
    if args.child:
        return child(args)
    prompts = needle_prompts([n for n, _ in PROMPTS])
    kept = run_child(__file__, args.kvpress_python, prompts)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "made_by": "scripts/make_kvpress_goldens_new.py (kvpress 0.5.5, transformers 5.2.0, torch 2.13.0 CPU, fp32, "
                   "sdpa, the embedded SmolLM2-135M-Instruct)",
        "prompts": [{"ids": ids, "budget": b} for ids, (_, b) in zip(prompts, PROMPTS)],
        "cases": {name: {"method": m, "fields": f, "press": press, "kept": kept[name]}
                  for name, (m, f, press) in CASES.items()},
    }))
    print(f"wrote {OUT.relative_to(ROOT)}: {len(CASES)} presses x {len(prompts)} prompts")


if __name__ == "__main__":
    main()
