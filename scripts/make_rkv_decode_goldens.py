"""Golden first decode compressions of R-KV's reference code (Zefan-Cai/R-KV) for tests/unit/test_rkv_decode.py.

    python scripts/make_rkv_decode_goldens.py --rkv-repo <a checkout of Zefan-Cai/R-KV> \
        [--out tests/fixtures/rkv/decode_goldens.json]

Needs the transformers the reference was written for (4.51: its attention forward writes `key_cache`), so run it
with an interpreter that has it (e.g. a venv with `transformers==4.51.3` and torch). It patches a tiny Llama with the
reference's own `replace_llama` (rkv/monkeypatch.py, rkv/modeling.py: the query cache, `CausalLM_forward`'s
`length % divide_length` trigger, `R1KV.update_kv`; the package's __init__ files import modules missing from the
repository, so the files are loaded by path), decodes greedily from prompts just below, at and above a multiple of
`divide_length` (128, the reference's default), and records, per layer and KV head, the original positions the
first decode compression kept (found by matching the rows `update_kv` returns to its input), the step it ran at and
the tokens generated. Nothing of the reference is copied into kvbench. Made from commit d15c976 of the reference.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path

import torch

CONFIG = dict(vocab_size=256, hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=2, max_position_embeddings=4096)
BUDGET, WINDOW, DIVIDE_LENGTH = 32, 8, 128
PROMPT_LENGTHS = [120, 121, 122, 127, 128, 129]  # first decode compression at step 9, 8, 7, 2, 1 and 128


def init_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Seeded weights that do not depend on the transformers version (the test builds the same model)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=g)
            param.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.15 * noise)


def prompt(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def first_step(prompt_len: int, divide_length: int = DIVIDE_LENGTH) -> int:
    """The decode step (1 = the first generated token's forward) of the first decode compression: the step after
    the one whose sequence length was a multiple of `divide_length`."""
    return (-prompt_len) % divide_length + 1


def load_module(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_reference(repo: Path) -> types.ModuleType:
    """The reference's `rkv.monkeypatch`, its packages built by hand around the files that exist."""
    for name in ("rkv", "rkv.compression"):
        package = types.ModuleType(name)
        package.__path__ = []
        sys.modules[name] = package
    utils = load_module("rkv.utils", repo / "rkv/utils.py")
    compression = sys.modules["rkv.compression"]
    compression.cal_similarity, compression.compute_attention_scores = utils.cal_similarity, utils.compute_attention_scores
    for stem, cls in [("r1_kv", "R1KV"), ("snapkv", "SnapKV"), ("streamingllm", "StreamingLLM"), ("h2o", "H2O"),
                      ("analysiskv", "AnalysisKV")]:
        setattr(compression, cls, getattr(load_module(f"rkv.compression.{stem}", repo / f"rkv/compression/{stem}.py"),
                                          cls))
    load_module("rkv.modeling", repo / "rkv/modeling.py")
    return load_module("rkv.monkeypatch", repo / "rkv/monkeypatch.py")


class Recorder:
    """Wraps `R1KV.update_kv`: per layer, the original positions of the cache's entries per head in the cache's
    order, and the kept positions of the prefill's call and of the first call while decoding. `by_position`: the
    rows it returns are put back in position order (kvbench's storage order) before they reach the cache."""

    def __init__(self, r1kv, by_position: bool):
        self.original, self.positions, self.seen, self.prefill, self.first = r1kv.update_kv, {}, {}, {}, {}
        self.step, self.by_position = 0, by_position
        recorder = self

        def update_kv(kv_self, key_states, query_states, value_states):
            kept_keys, kept_values = recorder.original(kv_self, key_states, query_states, value_states)
            order = recorder.note(kv_self, key_states, kept_keys)
            if recorder.by_position:
                index = order[None, :, :, None].expand_as(kept_keys)
                kept_keys, kept_values = kept_keys.gather(2, index), kept_values.gather(2, index)
            return kept_keys, kept_values
        r1kv.update_kv = update_kv

    def note(self, kv_self, keys: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """Records the call; returns the order `[H, k]` that sorts the kept rows by position."""
        layer, n = id(kv_self), keys.shape[-2]
        if layer not in self.positions:  # the prefill: every prompt position
            self.positions[layer], self.seen[layer] = [list(range(n))] * keys.shape[1], n
        held = self.positions[layer]
        new = n - len(held[0])  # entries appended since the last call: the newest positions
        heads = [h + list(range(self.seen[layer], self.seen[layer] + new)) for h in held]
        self.seen[layer] += new
        rows = [[int((keys[0, h] == row).all(-1).nonzero()[0]) for row in kept[0, h]] for h in range(keys.shape[1])]
        kept_positions = torch.tensor([[heads[h][i] for i in rows[h]] for h in range(len(heads))])
        order = kept_positions.argsort(dim=-1)
        self.positions[layer] = (kept_positions.gather(1, order) if self.by_position else kept_positions).tolist()
        record = kept_positions.sort(dim=-1).values.tolist()
        if not self.step:
            self.prefill[layer] = record
        elif layer not in self.first:
            self.first[layer] = {"step": self.step, "kept": record}
        return order


def run_case(monkeypatch: types.ModuleType, prompt_len: int, by_position: bool) -> dict:
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    r1kv = sys.modules["rkv.compression"].R1KV
    recorder = Recorder(r1kv, by_position)
    try:
        compression_config = {"method": "rkv", "method_config": {"budget": BUDGET, "window_size": WINDOW,
                                                                  "mix_lambda": 0.07, "retain_ratio": 0.2,
                                                                  "retain_direction": "last", "first_tokens": 4},
                              "compression": None, "update_kv": True}
        monkeypatch.replace_llama(compression_config)  # as run_math.py, before the model is built
        config = LlamaConfig(**CONFIG, attn_implementation="eager")
        model = LlamaForCausalLM(config).eval()
        model.config.update({"divide_method": "step_length", "divide_length": DIVIDE_LENGTH,
                             "compression_content": "all"})
        init_weights(model)
        ids, cache, tokens = prompt(prompt_len), DynamicCache(), []
        steps = first_step(prompt_len)
        with torch.no_grad():
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True,
                           cache_position=torch.arange(prompt_len)).logits
            for step in range(1, steps + 1):
                tokens.append(int(logits[0, -1].argmax()))
                recorder.step = step
                logits = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True,
                               cache_position=torch.tensor([prompt_len + step - 1])).logits
        clusters = [id(layer.self_attn.kv_cluster) for layer in model.model.layers]
        layers, prefill = [recorder.first[c] for c in clusters], [recorder.prefill[c] for c in clusters]
    finally:
        r1kv.update_kv = recorder.original
    assert {layer["step"] for layer in layers} == {steps}, (prompt_len, layers)
    return {"prompt_len": prompt_len, "step": steps, "tokens": tokens, "prefill_kept": prefill,
            "kept": [layer["kept"] for layer in layers]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rkv-repo", type=Path, required=True)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parents[1] / "tests/fixtures/rkv/decode_goldens.json")
    args = parser.parse_args()
    monkeypatch = load_reference(args.rkv_repo)
    commit = subprocess.run(["git", "-C", str(args.rkv_repo), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or None
    cases = []
    for n in PROMPT_LENGTHS:
        case, as_stored = run_case(monkeypatch, n, by_position=True), run_case(monkeypatch, n, by_position=False)
        assert case["tokens"] == as_stored["tokens"] and case["prefill_kept"] == as_stored["prefill_kept"]
        cases.append({**case, "kept_score_order": as_stored["kept"]})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"reference": "Zefan-Cai/R-KV", "commit": commit, "budget": BUDGET,
                                    "window": WINDOW, "divide_length": DIVIDE_LENGTH, "cases": cases}) + "\n")
    print(f"wrote {len(cases)} cases to {args.out}")


if __name__ == "__main__":
    main()
