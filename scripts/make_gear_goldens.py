"""Golden read-backs of GEAR's reference compression (opengear-project/GEAR) for tests/unit/test_gear.py.

    python scripts/make_gear_goldens.py --gear-file <GEAR checkout>/GenerationBench/GenerationTest/GEARLM/Simulated/compress_function.py
        [--commit <sha>] [--out tests/fixtures/gear/goldens.json]

Runs the reference's `gearslkivi_channelQ_new` (keys) and `gearslkivi_tokenQ_new` (values), loaded by path, on
seeded keys and values with outliers planted, torch's global generator seeded with the case's seed right before each
call (the reference's power iteration draws its random start from it), and records what each returns (the
states as the reference's attention would read them, before its final fp16 cast). Nothing of the reference is copied
into kvbench; the JSON holds the seeds, shapes, settings and the read-back tensors.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

# (seed, heads, tokens, head dim, bits, group, sparsity, rank, loop); outliers per row: int(H x D x sparsity / 2)
# (the reference's count): 4, 4, 0, 0
CASES = [(0, 2, 40, 16, 2, 16, 0.25, 2, 3), (1, 2, 64, 8, 4, 8, 0.5, 3, 2), (2, 3, 37, 16, 2, 16, 0.02, 0, 1),
         (3, 1, 48, 16, 4, 16, 0.0, 4, 3)]


def states(seed: int, heads: int, tokens: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values `[1, heads, tokens, d]`, a few large entries planted (outliers); the test rebuilds them."""
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(1, heads, tokens, d, generator=g), torch.randn(1, heads, tokens, d, generator=g)
    for x in (keys, values):
        where = torch.randint(0, x.numel(), (max(1, x.numel() // 50),), generator=g)
        x.view(-1)[where] *= 8
    return keys, values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gear-file", type=Path, required=True)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parents[1] / "tests/fixtures/gear/goldens.json")
    args = parser.parse_args()
    ref: dict = {}
    exec(compile(args.gear_file.read_text(), str(args.gear_file.name), "exec"), ref)
    cases = []
    for seed, heads, tokens, d, bits, group, sparsity, rank, loop in CASES:
        keys, values = states(seed, heads, tokens, d)
        torch.manual_seed(seed)
        k = ref["gearslkivi_channelQ_new"](keys.clone(), bits, group, sparsity, rank, loop)
        torch.manual_seed(seed + 1)
        v = ref["gearslkivi_tokenQ_new"](values.clone(), bits, group, sparsity, rank, loop)
        cases.append(dict(seed=seed, heads=heads, tokens=tokens, head_dim=d, bits=bits, group=group, sparsity=sparsity,
                          rank=rank, loop=loop, keys=k[0].tolist(), values=v[0].tolist()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(reference="opengear-project/GEAR", commit=args.commit,
                                        file="GenerationBench/GenerationTest/GEARLM/Simulated/compress_function.py",
                                        cases=cases)) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
