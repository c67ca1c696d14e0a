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
before each layer's attention, which is kvbench's per-layer generator. Kept sets are stored as hex bitmasks (bit i = entry i) per layer and head.
This file imports only the standard library at its top, so kvpress's interpreter can run it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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
    from contextlib import nullcontext

    import torch
    import kvpress
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(2)
    prompts = json.loads(Path(args.ids_file).read_text())
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="sdpa")
    attention = [layer.self_attn for layer in model.model.layers]
    def seed_hook(i):
        def hook(module, args, kwargs):
            torch.manual_seed(SEED + i)
        return hook

    # LeverageScorePress's sketch: the global generator seeded with seed + layer before each layer's attention
    hooks = [m.register_forward_pre_hook(seed_hook(i), with_kwargs=True) for i, m in enumerate(attention)]

    def run(ids, press=None):
        cache = DynamicCache()
        with torch.no_grad(), (press(model) if press is not None else nullcontext()):
            model(torch.tensor([ids]), past_key_values=cache, logits_to_keep=1)
        return [layer.keys[0] for layer in cache.layers]

    out = {}
    for p, ids in enumerate(prompts):
        full = run(ids)
        for name, (_, _, build) in CASES.items():
            press = eval(build, vars(kvpress))
            press.compression_ratio = ratio_for(build, len(ids), PROMPTS[p][1])
            kept = run(ids, press)
            masks = []
            if name in MASKING:  # kept = every entry the press did not mask, per layer and head
                for module, k_full in zip(attention, full):
                    _, heads_idx, seq_idx = module.masked_key_indices
                    dropped = [set(seq_idx[heads_idx == h].tolist()) for h in range(k_full.shape[0])]
                    masks.append([hex(sum(1 << i for i in set(range(len(ids))) - d)) for d in dropped])
                out.setdefault(name, []).append(masks)
                continue
            for k_full, k_kept in zip(full, kept):
                heads = []
                for h in range(k_full.shape[0]):
                    match = (k_kept[h][:, None, :] == k_full[h][None]).all(-1)  # [kept, n]
                    assert (match.sum(-1) == 1).all(), (name, "a kept key equals no single uncompressed key")
                    idx = match.float().argmax(-1).tolist()
                    heads.append(hex(sum(1 << i for i in set(idx))))
                masks.append(heads)
            out.setdefault(name, []).append(masks)
            print(name, p, file=sys.stderr, flush=True)
    for h in hooks:
        h.remove()
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
    from kvbench.data.niah import NeedleHaystack
    from kvbench.models import ModelSpec, load
    from kvbench.models.embedded import embedded_model_dir

    _, tok = load(ModelSpec(name="goldens", path="embedded"))
    prompts = []
    for n, _ in PROMPTS:
        sample = NeedleHaystack(context_lengths=[n + 200], depth_percents=[50]).build(tok, 100_000)[0]
        prompts.append(tok(sample.prompt).input_ids[:n])
    ids_file = Path(tempfile.mkdtemp()) / "ids.json"
    ids_file.write_text(json.dumps(prompts))
    cmd = [args.kvpress_python, __file__, "--child", "--ids-file", str(ids_file), "--model-dir",
           str(embedded_model_dir())]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode:
        sys.exit(f"make_kvpress_goldens_new: kvpress ({args.kvpress_python}) failed:\n{done.stderr[-3000:]}")
    kept = json.loads(done.stdout.splitlines()[-1])
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
