"""Golden kept sets from kvpress 0.5.5 for the learned methods (tests/fixtures/kvpress_learned/goldens.json).

    python scripts/make_kvpress_goldens_learned.py --kvpress-python /tmp/kvp/bin/python

As scripts/make_kvpress_goldens_new.py (same two prompts, read from its fixture; same embedded SmolLM2 in fp32, sdpa;
kvpress in its own venv as a child process), with each press given kvbench's artefacts instead of its Hub or GitHub
download (the child replaces the press's loader): QFilterPress and ExpectedAttentionStatsPress the embedded model's
committed filters and statistics (kvbench/methods/learned/, scripts/make_learned_artefacts.py), DuoAttentionPress
the committed head scores with sink 16 and recent 64 (the pattern's 128 + 256 exceed the prompts), LUKVPress a test
curve (tests/fixtures/kvpress_learned/lukv_curve.npy: seeded random per-head prune ratios around each target ratio,
made here; no LU-KV curve exists for this model). Presses that remove entries are read by matching kept keys to the
uncompressed ones; DuoAttention and LU-KV mask, and their kept set is every entry not in `masked_key_indices`.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from kvpress_golden_common import (ROOT, golden_parser, load_model, matched_masks, prefill_keys, run_child,
                                   unmasked_masks)

OUT = ROOT / "tests/fixtures/kvpress_learned/goldens.json"
CURVE = OUT.parent / "lukv_curve.npy"
PROMPTS = ROOT / "tests/fixtures/kvpress_new/goldens.json"
LEARNED = ROOT / "kvbench/methods/learned/SmolLM2-135M-Instruct"
DUO_SIZES, DUO_RATIO = (16, 64), 0.5

# name -> (kvbench method, its fields, the press, True if it masks)
CASES = {
    "qfilter": ("qfilter", {"filters": f"{LEARNED}_qfilters.safetensors"}, "QFilterPress()", False),
    "ea_stats": ("expected_attention", {"stats": f"{LEARNED}_ea_stats.safetensors"},
                 "ExpectedAttentionStatsPress()", False),
    "duo_attention": ("duo_attention", {"pattern": f"{LEARNED}_duo_attention.tsv", "head_ratio": DUO_RATIO,
                                        "sink_size": DUO_SIZES[0], "recent_size": DUO_SIZES[1]},
                      f"DuoAttentionPress(head_compression_ratio={DUO_RATIO})", True),
    "lukv": ("lukv", {"curve": str(CURVE)}, "LUKVPress(ExpectedAttentionPress(epsilon=2e-2), sink=4, window=1)", True),
}


def make_curve(n_layers: int, n_heads: int):
    """Per-head prune ratios for each target 1..99 %: the target plus seeded noise (+-0.2, zero mean per layer)."""
    import numpy as np

    rng = np.random.default_rng(0)
    noise = rng.uniform(-0.2, 0.2, (99, n_layers, n_heads))
    noise -= noise.mean(axis=-1, keepdims=True)
    target = (np.arange(1, 100) / 100)[:, None, None]
    return np.clip(target + noise, 0, 0.99).astype(np.float32)


def child(args) -> None:
    """In kvpress's interpreter: kept bitmasks per case and prompt, one JSON document on stdout."""
    import numpy as np
    import kvpress
    from safetensors.torch import load_file

    prompts = json.loads(Path(args.ids_file).read_text())
    model = load_model(args.model_dir)
    attention = [layer.self_attn for layer in model.model.layers]
    filters = load_file(f"{LEARNED}_qfilters.safetensors")["q_filters"].float()
    stats = load_file(f"{LEARNED}_ea_stats.safetensors")
    duo = np.clip(np.loadtxt(f"{LEARNED}_duo_attention.tsv", dtype=float, delimiter="\t"), 0, 1)
    curve = np.load(CURVE, allow_pickle=False)
    kvpress.QFilterPress.load_q_filters = staticmethod(lambda name: filters)
    kvpress.DuoAttentionPress.load_attention_pattern = staticmethod(lambda model: (*DUO_SIZES, duo))
    kvpress.LUKVPress._load_budget_curves = lambda self, model: curve

    def build(name, text, n, budget):
        press = eval(text, vars(kvpress))
        if name == "ea_stats":
            press.mu, press.cov = stats["query_mean"].float(), stats["query_cov"].float()
        if name != "duo_attention":  # (DuoAttention's ratio comes from its heads)
            press.compression_ratio = 1 - (budget + 0.5) / n
        return press

    out = {}
    for p, prompt in enumerate(prompts):
        ids, n = prompt["ids"], len(prompt["ids"])
        full = prefill_keys(model, ids)
        for name, (_, _, text, masks_entries) in CASES.items():
            kept = prefill_keys(model, ids, build(name, text, n, prompt["budget"]))
            masks = unmasked_masks(attention, n, full[0].shape[0]) if masks_entries else matched_masks(kept, full, name)
            out.setdefault(name, []).append(masks)
            print(name, p, file=sys.stderr, flush=True)
    print(json.dumps(out))


def main() -> None:
    args = golden_parser(__doc__).parse_args()
    if args.child:
        return child(args)
    import numpy as np

    prompts = json.loads(PROMPTS.read_text())["prompts"]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.save(CURVE, make_curve(30, 3), allow_pickle=False)
    kept = run_child(__file__, args.kvpress_python, prompts)
    OUT.write_text(json.dumps({
        "made_by": "scripts/make_kvpress_goldens_learned.py (kvpress 0.5.5, transformers 5.2.0, fp32, sdpa, the "
                   "embedded SmolLM2-135M-Instruct)",
        "prompts": [{"n": len(p["ids"]), "budget": p["budget"]} for p in prompts],
        "cases": {name: {"method": m, "fields": {k: str(Path(v).relative_to(ROOT)) if k in ("filters", "stats",
                                                                                             "pattern", "curve")
                                                 else v for k, v in f.items()},
                         "press": press, "kept": kept[name]} for name, (m, f, press, _) in CASES.items()},
    }))
    print(f"wrote {OUT.relative_to(ROOT)}: {len(CASES)} presses x {len(prompts)} prompts")


if __name__ == "__main__":
    main()
