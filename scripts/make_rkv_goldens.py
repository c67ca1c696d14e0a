"""Golden selections of R-KV's reference code (Zefan-Cai/R-KV) for tests/unit/test_rkv.py.

    python scripts/make_rkv_goldens.py --rkv-repo <a checkout of Zefan-Cai/R-KV> [--out tests/fixtures/rkv/goldens.json]

Runs the reference `R1KV.update_kv` (rkv/compression/r1_kv.py, with rkv/utils.py's `compute_attention_scores` and
`cal_similarity`; the package's own __init__ imports modules missing from the repository, so the two files are
loaded by path) on seeded random keys and queries, and records which entries it kept per KV head (found by
matching the rows it returns to the input keys). Nothing of the reference is copied into kvbench; the JSON holds the
seeds, shapes, settings and the kept indices. Made from commit d15c976 of the reference.
"""
from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import torch

CASES = [  # (seed, n keys, query heads, KV heads, head dim, budget, window, mix_lambda, clustered keys)
    (0, 96, 6, 2, 16, 40, 8, 0.07, False),
    (1, 130, 4, 4, 32, 64, 8, 0.07, True),
    (2, 200, 8, 2, 16, 72, 16, 0.5, True),
    (3, 64, 6, 2, 16, 64, 8, 0.07, False),  # at the budget: everything kept
]


def inputs(seed: int, n: int, h_q: int, h_kv: int, d: int, clustered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys `[1, H_kv, n, d]` (with `clustered`, a third of them near-copies of a few others, so redundancy
    matters) and window queries `[1, H_q, 16, d]`; the test rebuilds them from the same seed."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, h_kv, n, d, generator=g)
    if clustered:
        base = keys[:, :, :5].clone()
        copies = torch.randint(0, 5, (n // 3,), generator=g)
        where = torch.randperm(n - 20, generator=g)[: n // 3] + 5
        keys[:, :, where] = base[:, :, copies] + 0.05 * torch.randn(1, h_kv, n // 3, d, generator=g)
    queries = torch.randn(1, h_q, 16, d, generator=g)
    return keys, queries


def load_reference(repo: Path):
    namespace: dict = {}
    exec(compile((repo / "rkv/utils.py").read_text(), "rkv/utils.py", "exec"), namespace)
    source = (repo / "rkv/compression/r1_kv.py").read_text().replace(
        "from . import cal_similarity, compute_attention_scores", "")
    exec(compile(source, "rkv/compression/r1_kv.py", "exec"), namespace)
    return namespace["R1KV"]


def command_line(description: str, fixture: str) -> tuple[argparse.Namespace, str | None]:
    """`--rkv-repo` and `--out` (default tests/fixtures/rkv/`fixture`), and the reference checkout's commit."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rkv-repo", type=Path, required=True)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parents[1] / "tests/fixtures/rkv" / fixture)
    args = parser.parse_args()
    commit = subprocess.run(["git", "-C", str(args.rkv_repo), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or None
    return args, commit


def main() -> None:
    args, commit = command_line(__doc__.splitlines()[0], "goldens.json")
    R1KV = load_reference(args.rkv_repo)
    cases = []
    for seed, n, h_q, h_kv, d, budget, window, mix_lambda, clustered in CASES:
        keys, queries = inputs(seed, n, h_q, h_kv, d, clustered)
        values = keys.flip(-1)
        kept_keys, _ = R1KV(budget=budget, window_size=window, mix_lambda=mix_lambda).update_kv(
            keys, queries[:, :, -window:], values)
        kept = [sorted(int((keys[0, h] == row).all(-1).nonzero()[0]) for row in kept_keys[0, h]) for h in range(h_kv)]
        cases.append({"seed": seed, "n": n, "query_heads": h_q, "kv_heads": h_kv, "head_dim": d, "budget": budget,
                      "window": window, "mix_lambda": mix_lambda, "clustered": clustered, "kept": kept})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"reference": "Zefan-Cai/R-KV", "commit": commit, "cases": cases}, indent=1) + "\n")
    print(f"wrote {len(cases)} cases to {args.out}")


if __name__ == "__main__":
    main()
