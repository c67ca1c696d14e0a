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
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(2)
    prompts = json.loads(Path(args.ids_file).read_text())
    models = {attn: AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32,
                                                         attn_implementation=attn) for attn in ("eager", "sdpa")}
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
            kept = []
            for i, layer in enumerate(model.model.layers):
                if masks:
                    _, head_idx, seq_idx = layer.self_attn.masked_key_indices
                    dropped = [set(seq_idx[head_idx == h].tolist()) for h in range(heads)]
                    kept.append([hex(sum(1 << j for j in set(range(n)) - d)) for d in dropped])
                    del layer.self_attn.masked_key_indices
                    continue
                k_kept, k_full = cache.layers[i].keys[0], full.layers[i].keys[0]
                row = []
                for h in range(heads):
                    match = (k_kept[h][:, None, :] == k_full[h][None]).all(-1)  # [kept, n]
                    assert (match.sum(-1) == 1).all(), (name, "a kept key equals no single uncompressed key")
                    row.append(hex(sum(1 << j for j in match.float().argmax(-1).tolist())))
                kept.append(row)
            out.setdefault(name, []).append(kept)
            print(name, p, file=sys.stderr, flush=True)
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvpress-python", default="/tmp/kvp/bin/python", help="a Python with kvpress 0.5.5")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated cases to (re)make; others are kept")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ids-file", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--tokenizer-dir", help=argparse.SUPPRESS)
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
    tmp = Path(tempfile.mkdtemp())
    (tmp / "ids.json").write_text(json.dumps(prompts))
    no_template = tmp / "tokenizer"  # the tokenizer without its chat template (KVgradPress: no prefix)
    no_template.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (no_template / f).write_bytes((embedded_model_dir() / f).read_bytes())
    config = json.loads((no_template / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (no_template / "tokenizer_config.json").write_text(json.dumps(config))
    cmd = [args.kvpress_python, __file__, "--child", "--ids-file", str(tmp / "ids.json"), "--model-dir",
           str(embedded_model_dir()), "--tokenizer-dir", str(no_template), "--cases", args.cases]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode:
        sys.exit(f"make_kvpress_goldens_scorers3: kvpress ({args.kvpress_python}) failed:\n{done.stderr[-3000:]}")
    kept = json.loads(done.stdout.splitlines()[-1])
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
