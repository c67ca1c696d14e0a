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

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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
    from contextlib import nullcontext

    import torch
    import kvpress
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(2)
    prompts = json.loads(Path(args.ids_file).read_text())
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="sdpa")
    def seed_hook(i):
        def hook(module, args, kwargs):  # (returns None: the call goes on unchanged)
            torch.manual_seed(SEED + i)
        return hook

    hooks = [layer.self_attn.register_forward_pre_hook(seed_hook(i), with_kwargs=True)
             for i, layer in enumerate(model.model.layers)]

    def run(ids, press=None):
        cache = DynamicCache()
        with torch.no_grad(), (press(model) if press is not None else nullcontext()):
            model(torch.tensor([ids]), past_key_values=cache, logits_to_keep=1)
        return [layer.keys[0] for layer in cache.layers]

    out, channels = {}, {}
    for ids, budget in prompts:
        full = run(ids)
        for name, (_, _, build) in CASES.items():
            press = eval(build, vars(kvpress))
            (press.presses[0] if name == "think" else press).compression_ratio = 1 - (budget + 0.5) / len(ids)
            fed = ids
            if name.startswith("finch"):  # the delimiter before the question: an id the prompt does not use
                press.delimiter_token_id = next(t for t in range(1, 1000) if t not in ids)
                fed = ids[:-QUESTION] + [press.delimiter_token_id] + ids[-QUESTION:]
            masks, kept_channels = [], []
            for k_full, k_kept in zip(full, run(fed, press)):
                heads, chans = [], []
                for h in range(k_full.shape[0]):
                    on = (k_kept[h] != 0).any(0)  # [D]: every channel but those ThinK zeroed
                    match = (k_kept[h][:, None, on] == k_full[h][None][..., on]).all(-1)  # [kept, n]
                    assert (match.sum(-1) == 1).all(), (name, "a kept key equals no single uncompressed key")
                    heads.append(hex(sum(1 << i for i in set(match.float().argmax(-1).tolist()))))
                    chans.append(hex(sum(1 << i for i in on.nonzero()[:, 0].tolist())))
                masks.append(heads)
                kept_channels.append(chans)
            out.setdefault(name, []).append(masks)
            channels.setdefault(name, []).append(kept_channels)
            print(name, len(ids), file=sys.stderr, flush=True)
    for h in hooks:
        h.remove()
    print(json.dumps({"kept": out, "channels": {"think": channels["think"]}}))


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
    from kvbench.models.embedded import embedded_model_dir

    prompts = json.loads(PROMPTS.read_text())["prompts"]
    ids_file = Path(tempfile.mkdtemp()) / "ids.json"
    ids_file.write_text(json.dumps([[p["ids"], p["budget"]] for p in prompts]))
    cmd = [args.kvpress_python, __file__, "--child", "--ids-file", str(ids_file), "--model-dir",
           str(embedded_model_dir())]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode:
        sys.exit(f"make_kvpress_goldens_more: kvpress ({args.kvpress_python}) failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.splitlines()[-1])
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
