"""What the kvpress golden scripts (scripts/make_kvpress_goldens*.py) share, so that each keeps only its presses.

kvpress 0.5.5 needs transformers < 5.3, so it runs in a venv of its own: most scripts start themselves again there
as a child (`run_child`), which loads the embedded SmolLM2 in fp32 (`load_model`), prefills each prompt without and
with a press (`prefill_keys`) and reads which entries each layer and KV head kept: a press that removes entries by
matching every kept key bit for bit to the uncompressed key it is a copy of (`matched_masks`; the layers after a
compressed one see the same hidden states, as kvpress compresses after each layer's attention), a press that only
masks by the complement of the module's `masked_key_indices` (`unmasked_masks`). Kept sets are hex bitmasks, bit i =
entry i kept. This module imports only the standard library at its top, so kvpress's interpreter can import it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KVPRESS_PYTHON = "/tmp/kvp/bin/python"
# what embedded_model_dir() returns, for the scripts that run in kvpress's venv only (no kvbench there to ask)
CONVERTED_MODEL = Path.home() / ".cache/kvbench/models/SmolLM2-135M-Instruct.Q4_1-v0.1.2"


def golden_parser(doc: str) -> argparse.ArgumentParser:
    """The options every child-running script takes: --kvpress-python, and the child's own hidden ones."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--kvpress-python", default=KVPRESS_PYTHON, help="a Python with kvpress 0.5.5")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ids-file", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    return ap


def embedded_model_dir() -> Path:
    """The converted embedded SmolLM2 folder (kvbench's, imported from this checkout)."""
    sys.path.insert(0, str(ROOT))
    from kvbench.models.embedded import embedded_model_dir as model_dir

    return model_dir()


def needle_prompts(lengths) -> list[list[int]]:
    """The first n token ids of a needle-in-a-haystack prompt of n + 200 tokens (needle at 50 %), for each n."""
    sys.path.insert(0, str(ROOT))
    from kvbench.data.niah import NeedleHaystack
    from kvbench.models import ModelSpec, load

    _, tok = load(ModelSpec(name="goldens", path="embedded"))
    prompts = []
    for n in lengths:
        sample = NeedleHaystack(context_lengths=[n + 200], depth_percents=[50]).build(tok, 100_000)[0]
        prompts.append(tok(sample.prompt).input_ids[:n])
    return prompts


def run_child(script: str, python: str, prompts, *extra: str, model_dir: Path | None = None):
    """Runs `script --child` in kvpress's interpreter on `prompts` (as --ids-file) and the model; its last stdout
    line, parsed (the child prints one JSON document; its progress goes to stderr)."""
    model_dir = model_dir or embedded_model_dir()
    with tempfile.TemporaryDirectory() as tmp:
        ids_file = Path(tmp) / "ids.json"
        ids_file.write_text(json.dumps(prompts))
        cmd = [python, script, "--child", "--ids-file", str(ids_file), "--model-dir", str(model_dir), *extra]
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode:
        sys.exit(f"{Path(script).stem}: kvpress ({python}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def tokenizer_without_template(model_dir: Path, dest: Path) -> Path:
    """A copy of the model's tokenizer without its chat template, in `dest`: kvpress's KVzip and KVgrad read the
    template from `model.config.name_or_path`, and kvbench's `sinks=repeated` reading has none."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(model_dir) / f, dest / f)
    config = json.loads((dest / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return dest


def load_model(model_dir, attn: str = "sdpa", threads: int = 2):
    """The model in fp32 with `attn` attention, torch on `threads` threads (the goldens were made with these)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation=attn).eval()


def seed_each_layer(model, seed: int) -> list:
    """kvbench's per-layer generator in kvpress: the global generator seeded with seed + layer before each layer's
    attention (LeverageScorePress's sketch draws from it). Returns the hooks, to remove."""
    import torch

    def seed_hook(i):
        def hook(module, args, kwargs):  # (returns None: the call goes on unchanged)
            torch.manual_seed(seed + i)
        return hook

    return [layer.self_attn.register_forward_pre_hook(seed_hook(i), with_kwargs=True)
            for i, layer in enumerate(model.model.layers)]


def prefill_keys(model, ids, press=None, logits_to_keep: int = 1) -> list:
    """Each layer's keys [H, n', D] after prefilling `ids` (under `press` if given), as kvpress's pipeline prefills."""
    from contextlib import nullcontext

    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad(), (press(model) if press is not None else nullcontext()):
        model(torch.tensor([ids]), past_key_values=cache, logits_to_keep=logits_to_keep)
    return [layer.keys[0] for layer in cache.layers]


def hex_mask(positions) -> str:
    """Kept positions as one hex integer, bit i = entry i."""
    return hex(sum(1 << i for i in set(positions)))


def matched_positions(kept, full, what: str = "", channels=None) -> list[int]:
    """The rows of `full` [n, D] that the rows of `kept` [k, D] are bit-for-bit copies of (compared on `channels`
    only, when given: ThinK zeroes the others)."""
    if channels is not None:
        kept, full = kept[:, channels], full[:, channels]
    match = (kept[:, None, :] == full[None]).all(-1)  # [k, n]
    assert bool((match.sum(-1) == 1).all()), (what, "a kept key equals no single uncompressed key")
    return match.float().argmax(-1).tolist()


def matched_masks(kept_layers, full_layers, what: str = "") -> list[list[str]]:
    """Per layer and KV head, the hex mask of the entries a removing press kept (keys [H, k, D] against [H, n, D])."""
    return [[hex_mask(matched_positions(kept[h], full[h], what)) for h in range(full.shape[0])]
            for kept, full in zip(kept_layers, full_layers)]


def unmasked_positions(module, n: int, heads: int) -> list[set]:
    """Per KV head, the positions a masking press left unmasked (all when `masked_key_indices` is None); clears the
    module's `masked_key_indices`, which eager attention would otherwise carry into the next prefill."""
    masked = getattr(module, "masked_key_indices", None)
    kept = [set(range(n)) for _ in range(heads)]
    if masked is not None:
        for h, i in zip(masked[1].tolist(), masked[2].tolist()):
            kept[h].discard(i)
    module.masked_key_indices = None
    return kept


def unmasked_masks(attention, n: int, heads: int) -> list[list[str]]:
    """Per layer (its attention module) and KV head, the hex mask of the entries a masking press left unmasked."""
    return [[hex_mask(kept) for kept in unmasked_positions(module, n, heads)] for module in attention]
