"""Golden kept sets from kvpress 0.5.5 for KVzip+, DMS and KVzap (tests/fixtures/kvpress_kvzipfam/goldens.json).

    /tmp/kvp/bin/python scripts/make_kvpress_goldens_kvzipfam.py      # kvpress's venv (transformers 5.2.0)

Runs kvpress itself (never kvbench) on the embedded SmolLM2-135M-Instruct converted folder (fp32, sdpa) and the two
prompts of tests/fixtures/kvpress/prompts.json (192 and 256 tokens of Paul Graham essays), each press inside
`with press(model): model(ids, past_key_values=DynamicCache())`. All three presses mask instead of removing: the kept
set of each layer and KV head is every entry not in the module's `masked_key_indices`.
- `KVzipPress(kvzip_plus_normalization=True)` at ratios 0.25 and 0.5, on a tokenizer copy without its chat template
  (kvbench's `sinks=repeated` reading, as tests/fixtures/kvpress/kvzip.json);
- `DMSPress(KnormPress(), threshold, sliding_window_size=WINDOW)` and `DMSPress(KVzapPress(model_type="linear"), ...)`
  with kvbench's shipped surrogate for this model (kvbench/methods/kvzap_surrogates/SmolLM2-135M-Instruct-linear, loaded
  by kvpress's own `KVzapModel.from_pretrained`), thresholds near the median score so that about half is evicted.
Near ties are recorded so the test can ignore them: DMS entries scoring within 1e-5 of the threshold, KVzip+ rows
whose cut falls within 1e-6 (relative) of another score. Masks: one hex integer per head, bit i = entry i kept.
"""
from __future__ import annotations

import importlib.metadata
import json
import tempfile
from pathlib import Path

from kvpress_golden_common import (CONVERTED_MODEL as MODEL, ROOT, load_model, prefill_keys,
                                   tokenizer_without_template, unmasked_masks)

OUT = ROOT / "tests/fixtures/kvpress_kvzipfam/goldens.json"
SURROGATE = ROOT / "kvbench/methods/kvzap_surrogates/SmolLM2-135M-Instruct-linear"
RATIOS = (0.25, 0.5)
WINDOW = 32  # DMS sliding window: 160 and 224 entries of the two prompts can go
THRESHOLDS = {"dms": -17.0, "kvzap": -3.7}  # near the median score on these prompts (see the printed fractions)


def main() -> None:
    import kvpress
    import torch
    import transformers

    prompts = json.loads((ROOT / "tests/fixtures/kvpress/prompts.json").read_text())["ids"]
    # KVzipPress reads the chat template from model.config.name_or_path
    no_template = tokenizer_without_template(MODEL, Path(tempfile.mkdtemp()))
    model = load_model(MODEL)
    attention = [layer.self_attn for layer in model.model.layers]
    surrogate = kvpress.presses.kvzap_press.KVzapModel.from_pretrained(str(SURROGATE)).float().eval()

    heads = model.config.num_key_value_heads
    cases = []
    for p, ids in enumerate(prompts):
        n = len(ids)
        for ratio in RATIOS:
            press = kvpress.KVzipPress(compression_ratio=ratio, kvzip_plus_normalization=True)
            near = []
            original_post = press.compress_post

            def compress_post(model_, press=press, ratio=ratio, near=near):
                scores = press.score_val.clone()[:, 0]  # [L, H, n]
                scores[..., : press.n_sink] = scores.amax() + 1.0
                flat = scores.flatten()
                cut = flat.sort().values[int(flat.numel() * ratio)]  # the lowest kept score
                close = ((scores - cut).abs() <= 1e-6 * cut.abs()).nonzero()[:, :2].tolist()
                near.extend(sorted({tuple(row) for row in close}))
                return original_post(model_)

            press.compress_post = compress_post
            model.config.name_or_path = str(no_template)
            prefill_keys(model, ids, press, logits_to_keep=0)
            model.config.name_or_path = str(MODEL)
            cases.append({"name": "kvzip_plus", "prompt": p, "ratio": ratio, "near": near,
                          "kept": unmasked_masks(attention, n, heads)})
        for name, scorer in (("dms", kvpress.KnormPress()), ("kvzap", kvpress.KVzapPress(model_type="linear"))):
            if name == "kvzap":  # kvbench's surrogate under the name kvpress would look up (never downloaded)
                scorer.kvzap_model_name = f"nvidia/KVzap-linear-{MODEL.name}"
                scorer.kvzap_model = surrogate
            press = kvpress.DMSPress(scorer, threshold=THRESHOLDS[name], sliding_window_size=WINDOW)
            near, original_score = [], scorer.score

            def score(module, *args, original_score=original_score, near=near, name=name, **kwargs):
                s = original_score(module, *args, **kwargs)  # [1, H, n]
                close = ((s[0, :, : n - WINDOW] - THRESHOLDS[name]).abs() <= 1e-5).nonzero().tolist()
                near.extend([int(module.layer_idx), h, i] for h, i in close)
                return s

            scorer.score = score
            prefill_keys(model, ids, press, logits_to_keep=0)
            kept = unmasked_masks(attention, n, heads)
            cases.append({"name": name, "prompt": p, "threshold": THRESHOLDS[name], "window": WINDOW,
                          "near": near, "kept": kept})
            evicted = 1 - sum(bin(int(h, 16)).count("1") for layer in kept for h in layer) / (n * 3 * len(kept))
            print(f"{name} prompt {p}: {evicted:.2f} of the entries evicted, {len(near)} near the threshold")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "made_by": f"scripts/make_kvpress_goldens_kvzipfam.py: kvpress {importlib.metadata.version('kvpress')}, "
                   f"transformers {transformers.__version__}, torch {torch.__version__}, fp32, sdpa, {MODEL.name}",
        "prompts": "tests/fixtures/kvpress/prompts.json",
        "presses": {"kvzip_plus": "KVzipPress(compression_ratio, kvzip_plus_normalization=True), no chat template",
                    "dms": f"DMSPress(KnormPress(), threshold={THRESHOLDS['dms']}, sliding_window_size={WINDOW})",
                    "kvzap": f"DMSPress(KVzapPress(model_type='linear'), threshold={THRESHOLDS['kvzap']}, "
                             f"sliding_window_size={WINDOW}), kvbench's shipped surrogate"},
        "cases": cases}, separators=(",", ":")) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}: {len(cases)} cases")


if __name__ == "__main__":
    main()
