"""Golden cache lengths from kvpress 0.5.5's CompressionRatioDecodingPress (tests/fixtures/kvpress_ratiodecode/).

    python scripts/make_kvpress_ratiodecode_goldens.py --kvpress-python /tmp/kvp/bin/python

kvpress runs in its own venv, as a child of this script (scripts/kvpress_golden_common.py), on the embedded
SmolLM2-135M-Instruct in fp32: it prefills a prompt without compression (the press acts while decoding only) and
generates greedily under `CompressionRatioDecodingPress(base_press, target_compression_ratio, compression_interval)`
with a forced length, recording every layer's cache length after each forward. What is golden is the schedule and
the size of each compression (max(1, int(seen (1 - ratio))), seen counting the step's token), which kvbench's
`decode_compression.ratio` must reproduce; not the kept sets (kvpress recomputes a scorer's queries from a buffer of
hidden states, kvbench reads the generated tokens' queries: see docs/methods.md's `DecodingPress` row). A press
whose layers differ in length would fail here: kvpress's uniform scorers give one length per step.
This file imports only the standard library at its top, so kvpress's interpreter can run it.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from kvpress_golden_common import ROOT, golden_parser, load_model, run_child

OUT = ROOT / "tests/fixtures/kvpress_ratiodecode/lengths.json"
# name -> (kvbench method, prompt tokens, new tokens, compression_interval, ratio, the base press as kvpress builds it)
CASES = {
    "streamingllm_half": ("streamingllm", 60, 70, 16, 0.5, "StreamingLLMPress(n_sink=4)"),
    "knorm_0.3": ("knorm", 45, 50, 10, 0.3, "KnormPress()"),
}


def child(args) -> None:
    """In kvpress's interpreter: per case, one cache length per forward (the prefill first), on stdout as JSON."""
    import kvpress
    import torch
    from transformers import DynamicCache

    model = load_model(args.model_dir)
    lengths: list[set[int]] = []
    model.register_forward_hook(lambda m, a, kw, out: lengths.append(
        {layer.keys.shape[2] for layer in kw["past_key_values"].layers}), with_kwargs=True)
    out = {}
    for name, (_, n_prompt, new, every, ratio, base) in CASES.items():
        ids = torch.randint(3, 1000, (1, n_prompt), generator=torch.Generator().manual_seed(n_prompt))
        press = kvpress.CompressionRatioDecodingPress(base_press=eval(base, vars(kvpress)), compression_interval=every,
                                                      target_compression_ratio=ratio)
        lengths.clear()
        with press(model):
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, past_key_values=DynamicCache())
        assert all(len(step) == 1 for step in lengths), (name, lengths)
        out[name] = [step.pop() for step in lengths]
        print(name, file=sys.stderr, flush=True)
    print(json.dumps(out))


def main() -> None:
    args = golden_parser(__doc__).parse_args()
    if args.child:
        return child(args)
    lengths = run_child(__file__, args.kvpress_python, [])
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "made_by": "scripts/make_kvpress_ratiodecode_goldens.py (kvpress 0.5.5, transformers 5.2.0, torch CPU, fp32, "
                   "sdpa, the embedded SmolLM2-135M-Instruct)",
        "cases": {name: {"method": m, "prompt_tokens": n, "new_tokens": new, "every": every, "ratio": ratio,
                         "press": f"CompressionRatioDecodingPress(base_press={base}, compression_interval={every}, "
                                  f"target_compression_ratio={ratio})", "lengths": lengths[name]}
                  for name, (m, n, new, every, ratio, base) in CASES.items()},
    }))
    print(f"wrote {OUT.relative_to(ROOT)}: {len(CASES)} cases")


if __name__ == "__main__":
    main()
