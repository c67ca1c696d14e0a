"""Golden kept sets from kvpress 0.5.5 for compactor, cap, finch and snapkv + ThinK (tests/fixtures/kvpress_more/).

    python scripts/make_kvpress_goldens_more.py --kvpress-python /tmp/kvp/bin/python

The protocol of scripts/make_kvpress_goldens_new.py (whose prompts, budgets and ratio rule it reuses, from
tests/fixtures/kvpress_new/goldens.json): kvpress runs in its own venv, as a child, on the same token ids and the
embedded SmolLM2-135M-Instruct in fp32 (sdpa); each layer's and KV head's kept entries are read back by matching the
kept keys bit for bit to the uncompressed ones. Per press:
- CompactorPress: `blending` set on both sides (kvpress's default, the ratio, is 1 - (B + 0.5) / n here, not
  kvbench's 1 - B / n); its LeverageScorePress draws the sketch from the global generator, seeded with seed + layer
  before each layer's attention (kvbench's per-layer generator).
- FinchPress: the question is the prompt's last QUESTION tokens; kvpress finds it by a delimiter token inserted before
  it (any id absent from the prompt: its embedding hook drops it again, so the model sees the same ids), and keeps the
  keys unrotated (`rerotate_keys=False`, so that they match bit for bit; the kept set is the same either way).
- ThinKPress composed after SnapKVPress (`ComposedPress`, the ratio set on SnapKV): ThinK zeroes the pruned key
  channels, so a head's kept channels are those not zero in all its kept keys, and kept keys are matched on them;
  the kept channels are stored as bitmasks too (`channels`).
This file imports only the standard library at its top, so kvpress's interpreter can run it.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from kvpress_golden_common import (ROOT, golden_parser, hex_mask, load_model, matched_positions, prefill_keys,
                                   run_child, seed_each_layer)

PROMPTS = ROOT / "tests/fixtures/kvpress_new/goldens.json"
OUT = ROOT / "tests/fixtures/kvpress_more/goldens.json"
SEED, QUESTION, BLENDING = 0, 12, 0.6

# name -> (kvbench method, its fields, the press as kvpress builds it: evaluated in the child)
CASES = {
    "compactor": ("compactor", {"seed": SEED, "blending": BLENDING}, f"CompactorPress(blending={BLENDING})"),
    "cap": ("cap", {}, "CapPress()"),
    "finch": ("finch", {}, "FinchPress(rerotate_keys=False)"),
    "finch_chunked": ("finch", {"chunk_length": 70}, "FinchPress(rerotate_keys=False, chunk_length=70)"),
    "think": ("snapkv", {"window": 64, "kernel": 5, "pooling": "avg", "key_channels": 0.5, "channel_window": 32},
              "ComposedPress([SnapKVPress(), ThinKPress(key_channel_compression_ratio=0.5)])"),
}


def child(args) -> None:
    """In kvpress's interpreter: kept bitmasks per case and prompt, one JSON document on stdout."""
    import kvpress

    prompts = json.loads(Path(args.ids_file).read_text())
    model = load_model(args.model_dir)
    hooks = seed_each_layer(model, SEED)  # CompactorPress's LeverageScorePress sketch
    out, channels = {}, {}
    for ids, budget in prompts:
        full = prefill_keys(model, ids)
        for name, (_, _, build) in CASES.items():
            press = eval(build, vars(kvpress))
            (press.presses[0] if name == "think" else press).compression_ratio = 1 - (budget + 0.5) / len(ids)
            fed = ids
            if name.startswith("finch"):  # the delimiter before the question: an id the prompt does not use
                press.delimiter_token_id = next(t for t in range(1, 1000) if t not in ids)
                fed = ids[:-QUESTION] + [press.delimiter_token_id] + ids[-QUESTION:]
            masks, kept_channels = [], []
            for k_full, k_kept in zip(full, prefill_keys(model, fed, press)):
                heads, chans = [], []
                for h in range(k_full.shape[0]):
                    on = (k_kept[h] != 0).any(0)  # [D]: every channel but those ThinK zeroed
                    heads.append(hex_mask(matched_positions(k_kept[h], k_full[h], name, channels=on)))
                    chans.append(hex_mask(on.nonzero()[:, 0].tolist()))
                masks.append(heads)
                kept_channels.append(chans)
            out.setdefault(name, []).append(masks)
            channels.setdefault(name, []).append(kept_channels)
            print(name, len(ids), file=sys.stderr, flush=True)
    for h in hooks:
        h.remove()
    print(json.dumps({"kept": out, "channels": {"think": channels["think"]}}))


def main() -> None:
    args = golden_parser(__doc__).parse_args()
    if args.child:
        return child(args)
    prompts = json.loads(PROMPTS.read_text())["prompts"]
    result = run_child(__file__, args.kvpress_python, [[p["ids"], p["budget"]] for p in prompts])
    kept = result["kept"]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "made_by": "scripts/make_kvpress_goldens_more.py (kvpress 0.5.5, transformers 5.2.0, torch 2.13.0 CPU, fp32, "
                   "sdpa, the embedded SmolLM2-135M-Instruct)",
        "prompts": "those of tests/fixtures/kvpress_new/goldens.json",
        "question_tokens": QUESTION,
        "cases": {name: {"method": m, "fields": f, "press": press, "kept": kept[name],
                         **({"channels": result["channels"][name]} if name in result["channels"] else {})}
                  for name, (m, f, press) in CASES.items()},
    }))
    print(f"wrote {OUT.relative_to(ROOT)}: {len(CASES)} presses x {len(prompts)} prompts")


if __name__ == "__main__":
    main()
