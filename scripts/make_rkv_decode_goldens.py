"""Golden compressions of R-KV's reference code (Zefan-Cai/R-KV) while decoding, for tests/unit/test_rkv_decode.py.

    python scripts/make_rkv_decode_goldens.py --rkv-repo <a checkout of Zefan-Cai/R-KV> \
        [--out tests/fixtures/rkv/decode_goldens.json]

Needs the transformers the reference was written for (4.51: its attention forward writes `key_cache`), so run it
with an interpreter that has it (e.g. a venv with `transformers==4.51.3` and torch). It patches a tiny Llama with the
reference's own `replace_llama` (rkv/monkeypatch.py, rkv/modeling.py: the query cache, `CausalLM_forward`'s
`length % divide_length` trigger, `R1KV.update_kv`; the package's __init__ files import modules missing from the
repository, so the files are loaded by path), decodes greedily from prompts just below, at and above a multiple of
`divide_length` (128, the reference's default) up to the first compression while decoding, and from one prompt
through three compressions (`divide_length` 16). It records the tokens, the steps of the compressions and, per
compression, layer and KV head, the original positions kept (found by matching the rows `update_kv` returns to its
input, in the cache's own order, which the reference keeps best first). Nothing of the reference is copied into
kvbench. Made from commit d15c976 of the reference.
"""
from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import torch

CONFIG = dict(vocab_size=256, hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=2, max_position_embeddings=4096)
BUDGET, WINDOW, DIVIDE_LENGTH = 32, 8, 128
PROMPT_LENGTHS = [120, 121, 122, 127, 128, 129]  # decoded up to the first decode compression: step 9, 8, 7, 2, 1, 128
REPEATED = [(47, 16, 40)]  # (prompt, divide_length, steps): compressions at steps 2, 18 and 34, each from the last


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
    compression.cal_similarity = utils.cal_similarity
    compression.compute_attention_scores = utils.compute_attention_scores
    for stem, cls in [("r1_kv", "R1KV"), ("snapkv", "SnapKV"), ("streamingllm", "StreamingLLM"), ("h2o", "H2O"),
                      ("analysiskv", "AnalysisKV")]:
        setattr(compression, cls, getattr(load_module(f"rkv.compression.{stem}", repo / f"rkv/compression/{stem}.py"),
                                          cls))
    load_module("rkv.modeling", repo / "rkv/modeling.py")
    return load_module("rkv.monkeypatch", repo / "rkv/monkeypatch.py")


class Recorder:
    """Wraps `R1KV.update_kv`: per layer, the original positions of the cache's entries per head in the cache's own
    order (the reference puts its kept entries best first), and the kept positions of every call, sorted."""

    def __init__(self, r1kv):
        self.original, self.positions, self.seen, self.calls = r1kv.update_kv, {}, {}, {}
        self.step = 0
        recorder = self

        def update_kv(kv_self, key_states, query_states, value_states):
            kept_keys, kept_values = recorder.original(kv_self, key_states, query_states, value_states)
            recorder.note(kv_self, key_states, kept_keys)
            return kept_keys, kept_values
        r1kv.update_kv = update_kv

    def note(self, kv_self, keys: torch.Tensor, kept: torch.Tensor) -> None:
        layer, n = id(kv_self), keys.shape[-2]
        if layer not in self.positions:  # the prefill: every prompt position
            self.positions[layer], self.seen[layer], self.calls[layer] = [list(range(n))] * keys.shape[1], n, []
        new = n - len(self.positions[layer][0])  # entries appended since the last call: the newest positions
        heads = [h + list(range(self.seen[layer], self.seen[layer] + new)) for h in self.positions[layer]]
        self.seen[layer] += new
        rows = [[int((keys[0, h] == row).all(-1).nonzero()[0]) for row in kept[0, h]] for h in range(keys.shape[1])]
        self.positions[layer] = [[heads[h][i] for i in rows[h]] for h in range(len(heads))]
        self.calls[layer].append({"step": self.step, "kept": [sorted(h) for h in self.positions[layer]]})


def run_case(monkeypatch: types.ModuleType, prompt_len: int, divide_length: int, steps: int) -> dict:
    """Decode `steps` tokens greedily after a prompt of `prompt_len`; every compression, the prefill's (step 0)
    and those while decoding, per layer."""
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    r1kv = sys.modules["rkv.compression"].R1KV
    recorder = Recorder(r1kv)
    try:
        compression_config = {"method": "rkv", "method_config": {"budget": BUDGET, "window_size": WINDOW,
                                                                  "mix_lambda": 0.07, "retain_ratio": 0.2,
                                                                  "retain_direction": "last", "first_tokens": 4},
                              "compression": None, "update_kv": True}
        monkeypatch.replace_llama(compression_config)  # as run_math.py, before the model is built
        model = LlamaForCausalLM(LlamaConfig(**CONFIG, attn_implementation="eager")).eval()
        model.config.update({"divide_method": "step_length", "divide_length": divide_length,
                             "compression_content": "all"})
        init_weights(model)
        ids, cache, tokens = prompt(prompt_len), DynamicCache(), []
        with torch.no_grad():
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True,
                           cache_position=torch.arange(prompt_len)).logits
            for step in range(1, steps + 1):
                tokens.append(int(logits[0, -1].argmax()))
                recorder.step = step
                logits = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True,
                               cache_position=torch.tensor([prompt_len + step - 1])).logits
        calls = [recorder.calls[id(layer.self_attn.kv_cluster)] for layer in model.model.layers]
    finally:
        r1kv.update_kv = recorder.original
    return {"prompt_len": prompt_len, "divide_length": divide_length, "tokens": tokens,
            "steps": [call["step"] for call in calls[0]], "kept": [[call["kept"] for call in layer] for layer in calls]}


def main() -> None:
    from make_rkv_goldens import command_line  # (here: the test imports this file alone, for its model)

    args, commit = command_line(__doc__.splitlines()[0], "decode_goldens.json")
    monkeypatch = load_reference(args.rkv_repo)
    cases = [run_case(monkeypatch, n, DIVIDE_LENGTH, first_step(n)) for n in PROMPT_LENGTHS] + [
        run_case(monkeypatch, n, every, steps) for n, every, steps in REPEATED]
    for case in cases:  # the reference compresses on the schedule kvbench follows
        every = case["divide_length"]
        assert case["steps"] == [0] + [s for s in range(1, len(case["tokens"]) + 1)
                                       if (case["prompt_len"] + s - 1) % every == 0], case["steps"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"reference": "Zefan-Cai/R-KV", "commit": commit, "budget": BUDGET,
                                    "window": WINDOW, "cases": cases}) + "\n")
    print(f"wrote {len(cases)} cases to {args.out}")


if __name__ == "__main__":
    main()
