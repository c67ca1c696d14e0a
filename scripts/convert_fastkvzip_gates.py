"""Convert the authors' published Fast KVzip gates (pickled .pt) to the safetensors file kvbench reads.

    PYTHONPATH=. python scripts/convert_fastkvzip_gates.py --model Qwen/Qwen3-8B --revision <commit>
    PYTHONPATH=. python scripts/convert_fastkvzip_gates.py --model Qwen/Qwen3-8B --pt q4_dim16_sink16.pt --revision <c>

Run it once where the Hub is reachable. The gates live in `Jang-Hyun/Fast-KVzip` as `<model name, lower-cased>/
q<G>_dim16_sink16.pt` (G = query heads per KV head; the name kvpress's `get_gate_id` builds), a `torch.save` of
{"module": [one state dict per layer], ...}. This script reads it with `torch.load(weights_only=True)` (numpy's
array reconstruction allowed, as kvpress does: no arbitrary pickle runs) at the pinned `--revision` (a commit of that
repository: check https://huggingface.co/Jang-Hyun/Fast-KVzip/commits/main), and writes every tensor in fp32 as
`layers.<i>.<name>` into kvbench's cache, where `method.gates=auto` finds it (`kvbench.methods.fastkvzip.gate_file`);
the repository, file and revision go into the file's metadata and from there into each run's manifest. kvbench itself
never unpickles anything. `--pt` converts a file already downloaded (its revision still required, for the record);
`--out` writes elsewhere (then run with `method.gates=<that file>`).
"""
from __future__ import annotations

import argparse
from pathlib import Path

REPO = "Jang-Hyun/Fast-KVzip"


def read_published(path: Path) -> list[dict]:
    """The per-layer state dicts of an authors' .pt file, unpickled with torch's weights-only loader."""
    import numpy as np
    import torch

    allowed = [np.ndarray, np.dtype, getattr(np, "_core", np.core).multiarray._reconstruct]
    allowed += [getattr(np.dtypes, name) for name in ("Float64DType", "Float32DType") if hasattr(np, "dtypes")]
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, weights_only=True, map_location="cpu")["module"]


def convert(layers: list[dict], out: Path, metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    from kvbench.methods.fastkvzip import PARAMS

    missing = [name for name in PARAMS if name not in layers[0]]
    if missing:
        raise SystemExit(f"convert_fastkvzip_gates: the file's layers lack {missing} (has {sorted(layers[0])})")
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({f"layers.{i}.{name}": layer[name].float().contiguous() for i, layer in enumerate(layers)
               for name in PARAMS}, str(out), metadata=metadata)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the model's Hub id, e.g. Qwen/Qwen3-8B")
    parser.add_argument("--revision", required=True, help=f"the commit of {REPO} the gates are read at")
    parser.add_argument("--pt", help="an already downloaded .pt file (default: download it)")
    parser.add_argument("--groups", type=int, help="query heads per KV head (default: from the model's config)")
    parser.add_argument("--out", help="the safetensors file to write (default: where gates=auto looks)")
    args = parser.parse_args()
    from kvbench.methods.fastkvzip import N_SINK_KEYS, OUTPUT_DIM, gate_file

    groups = args.groups
    if groups is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(args.model).get_text_config()
        groups = config.num_attention_heads // config.num_key_value_heads
    filename = f"{args.model.split('/')[-1].lower()}/q{groups}_dim{OUTPUT_DIM}_sink{N_SINK_KEYS}.pt"
    path = Path(args.pt) if args.pt else None
    if path is None:
        from huggingface_hub import hf_hub_download

        path = Path(hf_hub_download(REPO, filename, revision=args.revision))
    out = Path(args.out) if args.out else gate_file(args.model, groups)
    convert(read_published(path), out, {"repository": REPO, "filename": filename, "revision": args.revision})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
