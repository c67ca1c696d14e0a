"""Fast KVzip (Kim, Han & Yun, arXiv 2601.17668): KVzip's importance, predicted by a small learned gate per layer from
each token's attention input, without KVzip's reconstruction pass. Reference code: Janghyun1230/FastKVzip @ b152448
(`prefill/attention/gate.py: Weight`, training `optim.py` + `utils.py`) and NVIDIA/kvpress 0.5.5
(`kvpress/presses/fastkvzip_press.py: FastKVzipGate, FastKVzipPress`).

The gate (one per layer, fp32 here; the authors and kvpress: the gate's dtype): the post-norm hidden state `[n,
hidden]` of each prompt token is projected, per KV head h, to one 16-dim key k_h and, per query head g of its group,
one 16-dim query q_hg (with a bias), each RMS-normed (eps 1e-6, learned scale). Against 16 learned sink keys s_hj:
    score_h = mean_g 1 / (1 + Σ_j exp(s_hj·q_hg / 4 - (k_h·q_hg / 4 + b_hg)))
(computed as a sigmoid of logit - logsumexp(sink logits): the same value, never overflowing). The authors' training
code (`optim.py`) adds the bias b twice, their inference code and kvpress once: kvbench follows kvpress (once).

Selection (kvpress's `FastKVzipPress`): the first `n_sink` entries and a recent window (max(1, `window_ratio` x n)
entries below 32,000 tokens, else `window_size`) get score 1 (above any gate score), then one top-k over all layers
and KV heads keeps budget x layers x heads entries (`layerwise=false`; kvpress's switch `layerwise=true`: the same
count in every layer, a top-k over that layer's heads). Heads and layers keep different lengths, stored per head
(`kvbench.cache.varlen`; kvpress masks them). It is a reconstructor without a reconstruction: the engine hands the
gate's scores of every layer (`Method.input_scores`, called by the capture at prefill) to `select_all`.

Gates (`gates`): `auto` reads `<cache>/artefacts/fastkvzip/<model>/q<G>_dim16_sink16.safetensors` (`gate_file`):
- for a Hub model, the authors' published gate (`Jang-Hyun/Fast-KVzip`, a pickled .pt that kvbench never loads),
  converted once where the Hub is reachable by scripts/convert_fastkvzip_gates.py (a pinned revision, recorded in the
  file's metadata and the manifest);
- for the embedded SmolLM2, a gate trained by the authors' procedure by scripts/train_fastkvzip_embedded.py
  (3.3 M parameters: not committed);
a path reads that safetensors file; `random` is a seeded random gate shaped for the model (tests; scores mean
nothing). A run through the engine without `prepare` (unit tests) falls back to `random` with a warning.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor

from kvbench.methods.artefacts import EMBEDDED, cache_dir, describe, model_id, warn_unprepared
from kvbench.methods.base import Kind, Method
from kvbench.registry import METHODS


OUTPUT_DIM, N_SINK_KEYS, EPS = 16, 16, 1e-6  # the published gates' shape (q<G>_dim16_sink16) and Qwen3RMSNorm's eps
PARAMS = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "q_norm.weight", "k_norm.weight", "k_base", "b")
LONG_CONTEXT = 32000  # kvpress: from this length on the recent window is `window_size`


def gate_file(model_name: str, n_groups: int) -> Path:
    """Where `gates=auto` looks for a model's gate (the authors' file name, lower-cased model name)."""
    name = EMBEDDED if EMBEDDED in model_name else model_name.rstrip("/").split("/")[-1]
    filename = f"q{n_groups}_dim{OUTPUT_DIM}_sink{N_SINK_KEYS}.safetensors"
    return cache_dir() / "fastkvzip" / name.lower() / filename


def gate_scores(params: dict[str, Tensor], hidden: Tensor) -> Tensor:
    """One layer's gate: scores `[B, H_kv, n]` in (0, 1), fp32, from its attention input `[B, n, hidden]`;
    `params` as the authors' state dict names them (`PARAMS`; `k_base` `[H_kv, 1, S, d]`, `b` `[H_kv, 1, G]`)."""
    b_, n, _ = hidden.shape
    n_heads, _, _, d = params["k_base"].shape
    x = hidden.float()
    q = torch.nn.functional.linear(x, params["q_proj.weight"].float(), params["q_proj.bias"].float())
    k = torch.nn.functional.linear(x, params["k_proj.weight"].float())
    q = rms_norm(q.view(b_, n, n_heads, -1, d), params["q_norm.weight"])  # [B, n, H, G, d]
    k = rms_norm(k.view(b_, n, n_heads, 1, d), params["k_norm.weight"])  # [B, n, H, 1, d]
    logit = (q * k).sum(-1) / d ** 0.5 + params["b"].float()[:, 0]  # [B, n, H, G]
    sinks = torch.einsum("bnhgd,hsd->bnhgs", q, params["k_base"].float()[:, 0]) / d ** 0.5
    score = torch.sigmoid(logit - sinks.logsumexp(-1))  # = 1 / (1 + Σ_sink exp(sink - logit))
    return score.mean(-1).transpose(1, 2)


def kv_heads(config) -> int:
    """The model's KV heads, whatever its config calls them (Falcon's multi-query attention: one)."""
    if getattr(config, "multi_query", False) and not getattr(config, "new_decoder_architecture", False):
        return 1
    return (getattr(config, "num_key_value_heads", None) or getattr(config, "num_kv_heads", None)
            or config.num_attention_heads)


def rms_norm(x: Tensor, weight: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()


def random_gates(config, seed: int = 0) -> list[dict[str, Tensor]]:
    """Seeded gates shaped for `config` (nn.Linear's init scale, unit norms, random sink keys and biases)."""
    generator = torch.Generator().manual_seed(seed)
    hidden, h_q, h_kv = config.hidden_size, config.num_attention_heads, kv_heads(config)
    bound = hidden ** -0.5
    uniform = lambda *shape: (torch.rand(*shape, generator=generator) * 2 - 1) * bound  # noqa: E731
    return [{"q_proj.weight": uniform(h_q * OUTPUT_DIM, hidden), "q_proj.bias": uniform(h_q * OUTPUT_DIM),
             "k_proj.weight": uniform(h_kv * OUTPUT_DIM, hidden),
             "q_norm.weight": torch.ones(OUTPUT_DIM), "k_norm.weight": torch.ones(OUTPUT_DIM),
             "k_base": torch.randn(h_kv, 1, N_SINK_KEYS, OUTPUT_DIM, generator=generator),
             "b": torch.randn(h_kv, 1, h_q // h_kv, generator=generator)} for _ in range(config.num_hidden_layers)]


def load_gates(path: Path) -> tuple[list[dict[str, Tensor]], dict]:
    """Per-layer parameters from a safetensors file (`layers.<i>.<param>`) and its metadata (where it came from)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        tensors, metadata = {name: f.get_tensor(name) for name in f.keys()}, f.metadata() or {}
    n_layers = 1 + max(int(name.split(".")[1]) for name in tensors)
    return [{p: tensors[f"layers.{i}.{p}"].float() for p in PARAMS} for i in range(n_layers)], metadata


def check_gates(gates: list[dict[str, Tensor]], config, source: str) -> None:
    """One gate per layer, fed the model's hidden size, one key per KV head, one query per query head."""
    h_q, h_kv = config.num_attention_heads, kv_heads(config)
    got = (len(gates), gates[0]["q_proj.weight"].shape[1], gates[0]["k_base"].shape[0],
           gates[0]["q_proj.weight"].shape[0] // gates[0]["k_base"].shape[-1])
    want = (config.num_hidden_layers, config.hidden_size, h_kv, h_q)
    if got != want:
        raise ValueError(f"fastkvzip: the gates {source} have (layers, input, KV heads, query heads) = {got}, the "
                         f"model {want}; use the model's own gates (method.gates)")


@METHODS.register("fastkvzip")
@dataclass
class FastKVzip(Method):
    kind: ClassVar[Kind] = Kind.RECONSTRUCTOR  # one selection across layers (its scores need no reconstruction)
    scores_inputs: ClassVar[bool] = True
    own_storage: ClassVar[bool] = True  # per-head variable layers

    gates: str = "auto"  # auto | random | <path to a .safetensors gate file>
    layerwise: bool = False  # kvpress's switch: the same count per layer (top-k over its heads), not across layers
    n_sink: int = 4  # first entries always kept (score 1), inside the budget
    window_ratio: float = 0.02  # recent window: max(1, ratio x n) entries (kvpress), kept, inside the budget
    window_size: int = 4096  # the recent window from 32,000 tokens on (kvpress: its chunked-prefill window)

    def __post_init__(self):
        if self.gates not in ("auto", "random") and not Path(self.gates).expanduser().is_file():
            raise ValueError(f"fastkvzip: gates={self.gates!r} is not a file; give a .safetensors path or auto, random")
        if self.n_sink < 0 or self.window_size < 1 or not 0 <= self.window_ratio < 1:
            raise ValueError(f"fastkvzip: n_sink={self.n_sink} must be >= 0, window_size={self.window_size} >= 1, "
                             f"window_ratio={self.window_ratio} in [0, 1)")
        self._gates: list[dict[str, Tensor]] | None = None

    def check_budget(self, budget: int | None) -> None:
        super().check_budget(budget)
        self.check_below_budget("n_sink", budget, "sinks count inside the budget")

    def load(self, config, model_name: str) -> dict:
        """The gates `gates` names for the model (checked against its shape); what goes into the manifest."""
        n_groups = config.num_attention_heads // kv_heads(config)
        if self.gates == "random":
            self._gates, described = random_gates(config), {"source": "random"}
        else:
            path = gate_file(model_name, n_groups) if self.gates == "auto" else Path(self.gates).expanduser()
            if not path.is_file():
                script = ("scripts/train_fastkvzip_embedded.py" if EMBEDDED in model_name else
                          f"scripts/convert_fastkvzip_gates.py --model {model_name} --revision <commit> (Hub)")
                raise ValueError(f"fastkvzip: no gates for {model_name!r} at {path}; make them with {script}, or "
                                 "set method.gates=<file>")
            self._gates, metadata = load_gates(path)
            described = {**describe(path), **metadata}
        check_gates(self._gates, config, described.get("file", "random"))
        return described

    def prepare(self, model, tokenizer, *, prefill=None) -> dict | None:
        """Load the gates before the first sample, so a missing or misshapen file fails the run at its start."""
        return {"fastkvzip_gates": self.load(model.config.get_text_config(), model_id(model))}

    def input_scores(self, layer_idx: int, hidden: Tensor, config) -> Tensor:
        if self._gates is None:
            warn_unprepared(self, "a seeded random gate stands in (scores mean nothing)")
            self._gates = random_gates(config)
        params = {name: p.to(hidden.device) for name, p in self._gates[layer_idx].items()}
        return self.protect(gate_scores(params, hidden))

    def protect(self, scores: Tensor) -> Tensor:
        """Score 1 (above any gate score) for the sinks and the recent window (kvpress `_score_fast`)."""
        n = scores.shape[-1]
        window = max(1, int(n * self.window_ratio)) if n < LONG_CONTEXT else self.window_size
        scores[..., :self.n_sink] = 1.0
        scores[..., -window:] = 1.0
        return scores

    def select_all(self, scores: dict[int, Tensor], budget: int) -> dict[int, list[Tensor]]:
        """The top budget x layers x KV heads entries of every scored layer's `[1, H_kv, n]` (`layerwise`: the top
        budget x heads of each layer): per layer, one sorted index tensor per KV head. Empty when everything fits."""
        if not scores:
            return {}
        layers = sorted(scores)
        stacked = torch.stack([scores[i][0] for i in layers])  # [L, H, n]
        if scores[layers[0]].shape[0] != 1:
            raise ValueError("fastkvzip: per-head variable budgets need batch size 1")
        n_layers, n_heads, n = stacked.shape
        if budget >= n:
            return {}
        keep = torch.zeros_like(stacked, dtype=torch.bool).view(n_layers, -1)
        if self.layerwise:
            keep.scatter_(1, stacked.view(n_layers, -1).topk(budget * n_heads, dim=1).indices, True)
        else:
            keep.view(-1)[stacked.flatten().topk(budget * n_layers * n_heads).indices] = True
        keep = keep.view(n_layers, n_heads, n)
        return {i: [head.nonzero().flatten() for head in keep[k]] for k, i in enumerate(layers)}
