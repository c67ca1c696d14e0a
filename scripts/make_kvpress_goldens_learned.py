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

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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
    from contextlib import nullcontext

    import numpy as np
    import torch
    import kvpress
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(2)
    prompts = json.loads(Path(args.ids_file).read_text())
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="sdpa")
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

    def run(ids, press=None):
        cache = DynamicCache()
        with torch.no_grad(), (press(model) if press is not None else nullcontext()):
            model(torch.tensor([ids]), past_key_values=cache, logits_to_keep=1)
        return [layer.keys[0] for layer in cache.layers]

    out = {}
    for p, prompt in enumerate(prompts):
        ids, n = prompt["ids"], len(prompt["ids"])
        full = run(ids)
        for name, (_, _, text, masks_entries) in CASES.items():
            kept = run(ids, build(name, text, n, prompt["budget"]))
            masks = []
            for module, k_full, k_kept in zip(attention, full, kept):
                heads = []
                for h in range(k_full.shape[0]):
                    if masks_entries:
                        masked = getattr(module, "masked_key_indices", None)
                        dropped = set() if masked is None else set(masked[2][masked[1] == h].tolist())
                        idx = set(range(n)) - dropped
                    else:
                        match = (k_kept[h][:, None, :] == k_full[h][None]).all(-1)  # [kept, n]
                        assert (match.sum(-1) == 1).all(), (name, "a kept key equals no single uncompressed key")
                        idx = set(match.float().argmax(-1).tolist())
                    heads.append(hex(sum(1 << i for i in idx)))
                masks.append(heads)
            out.setdefault(name, []).append(masks)
            print(name, p, file=sys.stderr, flush=True)
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvpress-python", default="/tmp/kvp/bin/python", help="a Python with kvpress 0.5.5")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ids-file", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    sys.path.insert(0, str(ROOT))
    import numpy as np

    from kvbench.models.embedded import embedded_model_dir

    prompts = json.loads(PROMPTS.read_text())["prompts"]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.save(CURVE, make_curve(30, 3), allow_pickle=False)
    ids_file = OUT.parent / ".ids.json"
    ids_file.write_text(json.dumps(prompts))
    cmd = [args.kvpress_python, __file__, "--child", "--ids-file", str(ids_file), "--model-dir",
           str(embedded_model_dir())]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    ids_file.unlink()
    if done.returncode:
        sys.exit(f"make_kvpress_goldens_learned: kvpress ({args.kvpress_python}) failed:\n{done.stderr[-3000:]}")
    kept = json.loads(done.stdout.splitlines()[-1])
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
