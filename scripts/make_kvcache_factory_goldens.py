"""Golden selections of KVCache-Factory's 2026 selector code for tests/unit/test_nacl_scissorhands.py.

    python scripts/make_kvcache_factory_goldens.py --factory-repo <a checkout of Zefan-Cai/KVCache-Factory>
        [--out tests/fixtures/kvcache_factory/goldens.json]

Runs the reference's pure-PyTorch functions (`pyramidkv/nacl.py`: `select_nacl_proxy_indices`,
`select_nacl_tokens`; `pyramidkv/scissorhands.py`: `update_scissorhands_importance`, `select_scissorhands_tokens`;
`pyramidkv/minicache.py`: `compress_minicache_pair`, `restore_minicache_pair`; each file loaded by path) on seeded random keys and queries (one KV head per query head, the reference's layout),
with the attention computed here eagerly over the full causal n x n matrix (the reference takes attention as input).
For MiniCache the JSON holds the retained indices and the restored states of both layers (two adjacent layers'
states: seeded, the deeper one a perturbed copy of the other, as adjacent layers are similar).
Nothing of the reference is copied into kvbench; the JSON holds the seeds, shapes, settings and the kept indices.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
from pathlib import Path

import torch

# NACL: (seed, n, heads, head dim, budget, proxy, sinks, random budget, temperature)
NACL_CASES = [(0, 64, 2, 16, 24, 8, 0, 0, 1.0), (1, 90, 3, 16, 40, 16, 4, 0, 1.0), (2, 80, 2, 16, 30, 8, 2, 6, 0.0),
              (3, 120, 4, 8, 50, 8, 0, 12, 0.0)]
# Scissorhands prefill: (seed, n, heads, head dim, budget, history window or None, recent, sinks)
SCISSOR_CASES = [(0, 64, 2, 16, 24, None, 0, 0), (1, 90, 3, 16, 40, 16, 8, 4), (2, 100, 2, 8, 36, 30, 4, 0)]
# Scissorhands decoding: (seed, n prompt, heads, head dim, budget, steps, decay, recent, sinks)
SCISSOR_DECODE = [(5, 40, 2, 16, 24, 12, 0.5, 4, 2), (6, 50, 2, 8, 30, 10, 1.0, 0, 0)]

# MiniCache: (seed, n, heads, head dim, interpolation, retention ratio, perturbation of the deeper layer)
MINICACHE_CASES = [(0, 24, 2, 8, 0.6, 0.05, 0.3), (1, 40, 3, 16, 0.5, 0.2, 1.0), (2, 17, 2, 8, 0.6, 0.1, 0.05)]


def inputs(seed: int, n: int, heads: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and queries `[1, heads, n, d]` (queries at positions 0..n-1); the test rebuilds them from the seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, heads, n, d, generator=g), torch.randn(1, heads, n, d, generator=g)


def causal_attention(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Eager softmax over the full causal matrix `[1, H, n, n]` (rows at positions 0..n-1)."""
    n, d = keys.shape[2], keys.shape[3]
    logits = (queries.double() @ keys.double().transpose(-1, -2)) / math.sqrt(d)
    logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return logits.softmax(dim=-1).float()


def decode_inputs(seed: int, n: int, heads: int, d: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and queries for a prompt of n and `steps` decoded tokens `[1, heads, n + steps, d]`."""
    return inputs(seed, n + steps, heads, d)


def load(repo: Path, path: str) -> dict:
    namespace: dict = {}
    exec(compile((repo / path).read_text(), path, "exec"), namespace)
    return namespace


def nacl_cases(ref: dict) -> list[dict]:
    cases = []
    for seed, n, heads, d, budget, proxy, sinks, random_budget, temperature in NACL_CASES:
        keys, queries = inputs(seed, n, heads, d)
        proxy_idx = ref["select_nacl_proxy_indices"](n, proxy_size=proxy)
        kept = ref["select_nacl_tokens"](causal_attention(queries, keys), token_budget=budget,
                                         proxy_indices=proxy_idx, protected_indices=torch.arange(sinks),
                                         random_budget=random_budget, random_temperature=temperature,
                                         generator=torch.Generator().manual_seed(seed))
        cases.append(dict(seed=seed, n=n, heads=heads, head_dim=d, budget=budget, proxy_size=proxy, sink_size=sinks,
                          random_budget=random_budget, random_temperature=temperature, kept=kept[0].tolist()))
    return cases


def scissor_cases(ref: dict) -> list[dict]:
    cases = []
    for seed, n, heads, d, budget, history, recent, sinks in SCISSOR_CASES:
        keys, queries = inputs(seed, n, heads, d)
        importance = ref["update_scissorhands_importance"](None, causal_attention(queries, keys),
                                                           history_window=history)
        kept = ref["select_scissorhands_tokens"](importance, token_budget=budget, recent_size=recent,
                                                 sink_size=sinks)
        cases.append(dict(seed=seed, n=n, heads=heads, head_dim=d, budget=budget, history_window=history,
                          recent_size=recent, sink_size=sinks, kept=kept[0].tolist()))
    return cases


def scissor_decode_cases(ref: dict) -> list[dict]:
    """A prompt, then one token per step: each step's row over the entries held (its own included) updates the
    importance with `decay`, and the reference's selector evicts back to the budget; the kept original positions."""
    cases = []
    for seed, n, heads, d, budget, steps, decay, recent, sinks in SCISSOR_DECODE:
        keys, queries = decode_inputs(seed, n, heads, d, steps)
        importance = ref["update_scissorhands_importance"](None, causal_attention(queries[:, :, :n], keys[:, :, :n]))
        held = torch.arange(n).expand(1, heads, n)
        kept = ref["select_scissorhands_tokens"](importance, token_budget=budget, recent_size=recent, sink_size=sinks)
        held, importance = held.gather(-1, kept), importance.gather(-1, kept)
        for t in range(n, n + steps):
            held = torch.cat([held, torch.full((1, heads, 1), t)], dim=-1)
            k = keys[0, torch.arange(heads)[:, None], held[0]][None]  # [1, H, m, d]
            logits = (queries[:, :, t:t + 1].double() @ k.double().transpose(-1, -2)) / math.sqrt(d)
            row = logits.softmax(dim=-1).float()  # [1, H, 1, m]
            importance = torch.cat([importance, importance.new_zeros(1, heads, 1)], dim=-1)
            importance = ref["update_scissorhands_importance"](importance, row, decay=decay)
            kept = ref["select_scissorhands_tokens"](importance, token_budget=budget, recent_size=recent,
                                                     sink_size=sinks)
            held, importance = held.gather(-1, kept), importance.gather(-1, kept)
        cases.append(dict(seed=seed, n=n, heads=heads, head_dim=d, budget=budget, steps=steps, decay=decay,
                          recent_size=recent, sink_size=sinks, kept=held[0].tolist()))
    return cases


def pair_inputs(seed: int, n: int, heads: int, d: int, noise: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Two adjacent layers' states `[1, heads, n, d]`: the deeper one a perturbed, rescaled copy of the other."""
    g = torch.Generator().manual_seed(seed)
    previous = torch.randn(1, heads, n, d, generator=g)
    current = 1.5 * previous + noise * torch.randn(1, heads, n, d, generator=g)
    return previous, current


def minicache_cases(ref: dict) -> list[dict]:
    cases = []
    for seed, n, heads, d, t, ratio, noise in MINICACHE_CASES:
        previous, current = pair_inputs(seed, n, heads, d, noise)
        direction, cur_mag, prev_mag, _, cur_kept, prev_kept, idx = ref["compress_minicache_pair"](
            current, previous, interpolation=t, retention_ratio=ratio)
        cur, prev = ref["restore_minicache_pair"](direction, cur_mag, prev_mag, current_retained=cur_kept,
                                                  previous_retained=prev_kept, retained_indices=idx)
        cases.append(dict(seed=seed, n=n, heads=heads, head_dim=d, interpolation=t, retention_ratio=ratio,
                          noise=noise, retained=idx[0].tolist(), previous=prev[0].tolist(), current=cur[0].tolist()))
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--factory-repo", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1]
                        / "tests/fixtures/kvcache_factory/goldens.json")
    parser.add_argument("--commit", help="the reference's commit, for a copy of its files without .git")
    args = parser.parse_args()
    commit = args.commit or subprocess.run(["git", "-C", str(args.factory_repo), "rev-parse", "HEAD"],
                                           capture_output=True, text=True).stdout.strip() or None
    nacl, scissor = load(args.factory_repo, "pyramidkv/nacl.py"), load(args.factory_repo, "pyramidkv/scissorhands.py")
    minicache = load(args.factory_repo, "pyramidkv/minicache.py")
    out = dict(reference="Zefan-Cai/KVCache-Factory", commit=commit, nacl=nacl_cases(nacl),
               scissorhands=scissor_cases(scissor), scissorhands_decode=scissor_decode_cases(scissor),
               minicache=minicache_cases(minicache))
    lines = [f"{json.dumps(key)}: " + (json.dumps(value) if not isinstance(value, list) else
                                       "[\n  " + ",\n  ".join(json.dumps(case) for case in value) + "\n ]")
             for key, value in out.items()]  # one case per line
    args.out.write_text("{\n " + ",\n ".join(lines) + "\n}\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
