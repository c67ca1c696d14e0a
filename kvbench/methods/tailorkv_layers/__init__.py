"""TailorKV's offline layer identification: which layers are quantization-friendly (set Q) and which sparsity-friendly.

Reference: ydyhello/TailorKV@4e9fc81 (`search_pattern.py`, `models/modeling_llama_search.py`); the paper's
Sec. 4.1 (Eqs. 6-9) leaves n_q, k and the head reduction to the code. One calibration prompt is prefilled once; for
every layer, the last `last_q = 32` post-RoPE queries of all query heads attend over all n post-RoPE keys (KV
repeated to the query heads, as `repeat_kv`), softmax in fp32 cast back to the query dtype. The layer's sparse error
is

    score = (sum of all probabilities - sum of each row's top-k probabilities) / (w * H_q),   k = int(alpha * n)

i.e. the mean, over (query head, query), of the attention mass outside the top 5 % of keys. Dense layers (score >
tau = 0.2, strictly) are quantization-friendly; the rest are sparsity-friendly. The official code writes the result
by hand into `config/model2quantlayer.json` (Llama-3.1-8B -> {0}); this command recomputes it for any model.

Quirks, their defaults and switches:
- No causal mask (reference): the last w queries also see up to w - 1 later keys. `causal=True` / `--causal` masks
  them; k stays int(alpha * n) either way.
- Normalised by w * H_q with w the number of queries present: `last_q` whenever the prompt has >= `last_q` tokens
  (the reference's `last_q * H_q`), the prompt length otherwise, so the score stays a mean in [0, 1].
- Probabilities are cast back to the query dtype before top-k (as the reference, fp16 there); the two sums are then
  accumulated in fp32 rather than in that dtype. For fp32 models this changes nothing.
- Logits are computed in the query dtype (as the reference) with the layer's own `scaling` (1/sqrt(head_dim) for
  the paper's models).
- Calibration prompt: the first 50 GSM8K `main` train pairs as `Question: ...\\nAnswer: ...\\n`, then one final
  question, no chat template, tokenized with the tokenizer's default special tokens. Without a local GSM8K file the
  command uses `kvbench.methods.tailorkv_calibration`, a self-written stand-in that is NOT GSM8K.

Memory: scores are computed one KV head at a time, `(H_q / H_kv) * w x n` logits, never the n x n matrix.

The prefill is the engine's, handed down by the caller (`prefill=`), since methods sit below the engine: the command
(`__main__.py`) passes it, and so does a run, through `TailorKV.prepare`.

    python -m kvbench.methods.tailorkv_layers                         # embedded SmolLM2, stand-in calibration
    python -m kvbench.methods.tailorkv_layers --model <dir> --calibration gsm8k_train.jsonl
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from kvbench.cache import KVCache
from kvbench.methods.tailorkv_calibration import stand_in_pairs
from kvbench.models.capture import AttentionCapture

FINAL_QUESTION = ("Question: John takes care of 10 dogs. Each dog takes .5 hours a day to walk and take care of "
                  "their business. How many hours a week does he spend taking care of dogs?")
N_SHOTS = 50  # GSM8K train pairs in the reference calibration prompt


@torch.no_grad()
def sparse_error(window_queries: Tensor, keys: Tensor, scaling: float, alpha: float = 0.05,
                 causal: bool = False) -> float:
    """One layer's score from queries `[1, H_q, w, D]` (the last w prompt positions) and keys `[1, H_kv, n, D]`."""
    b, h_q, w, d = window_queries.shape
    h_kv, n = keys.shape[1], keys.shape[2]
    if b != 1:
        raise ValueError(f"tailorkv_layers: batch={b}; identification runs one calibration prompt (batch 1)")
    if h_q % h_kv or keys.shape[3] != d or w > n:
        raise ValueError(f"tailorkv_layers: queries {tuple(window_queries.shape)} do not fit keys {tuple(keys.shape)}")
    group, top = h_q // h_kv, int(alpha * n)
    future = None
    if causal:  # query i sits at position n - w + i
        future = torch.arange(n, device=keys.device)[None] > torch.arange(n - w, n, device=keys.device)[:, None]
    mass = kept = 0.0
    for head in range(h_kv):  # one GQA group at a time: [group, w, n]
        q = window_queries[0, head * group:(head + 1) * group]
        logits = (q @ keys[0, head].transpose(0, 1)) * scaling
        if future is not None:
            logits = logits.masked_fill(future, float("-inf"))
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype)
        mass += probs.float().sum().item()
        kept += probs.topk(top, dim=-1).values.float().sum().item()
    return (mass - kept) / (w * h_q)


def quant_layers(scores: list[float], tau: float = 0.2) -> list[int]:
    """Layers whose score is strictly above `tau` (quantization-friendly); the reference's `error > beta`."""
    return [i for i, s in enumerate(scores) if s > tau]


@dataclass
class Identification:
    """What one identification run found, with the knobs that produced it (to log next to a run's 𝕈)."""

    scores: list[float]  # per layer, in [0, 1]
    quant_layers: list[int]  # score > tau: quantization-friendly; all others sparsity-friendly
    tau: float
    alpha: float
    last_q: int
    causal: bool
    prompt_len: int

    def label(self, layer: int) -> str:
        return "quantization-friendly" if layer in self.quant_layers else "sparsity-friendly"


@torch.no_grad()
def identify(model, input_ids: Tensor, last_q: int = 32, alpha: float = 0.05, tau: float = 0.2,
             causal: bool = False, *, prefill: Callable) -> Identification:
    """Prefill `input_ids` `[1, n]` once and score every layer; see the module docstring. `prefill` is the
    engine's (`kvbench.engine.generation.prefill`), handed down by the caller: methods do not import the engine."""
    if last_q < 1 or not 0 < alpha < 1:
        raise ValueError(f"tailorkv_layers: need last_q >= 1 and 0 < alpha < 1 (got {last_q}, {alpha})")
    device = next(model.parameters()).device
    cache = KVCache()
    with AttentionCapture(model, window=last_q) as capture:
        prefill(model, input_ids.to(device), cache)
        scores = [sparse_error(capture.window_queries[i], layer.keys, capture.scaling[i], alpha, causal)
                  for i, layer in enumerate(cache.layers)]
    return Identification(scores, quant_layers(scores, tau), tau, alpha, last_q, causal, input_ids.shape[1])


def identify_with_calibration(model, tokenizer, calibration: str | Path | None = None, **kwargs) -> Identification:
    """`identify` on the reference calibration prompt: a local GSM8K train file, else the self-written stand-in."""
    pairs = load_gsm8k_pairs(calibration) if calibration else stand_in_pairs()
    input_ids = tokenizer(calibration_prompt(pairs), return_tensors="pt").input_ids
    return identify(model, input_ids, **kwargs)


# --- calibration prompt ---------------------------------------------------------------------------------------
def calibration_prompt(pairs: list[tuple[str, str]]) -> str:
    """The reference format: `Question: q\\nAnswer: a\\n` per pair, then the final question (no trailing newline)."""
    return "".join(f"Question: {q}\nAnswer: {a}\n" for q, a in pairs) + FINAL_QUESTION


def load_gsm8k_pairs(path: str | Path, n: int = N_SHOTS) -> list[tuple[str, str]]:
    """The first `n` (question, answer) pairs of a local GSM8K train file: JSON lines, or .parquet (pandas)."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pandas as pd

        rows = pd.read_parquet(path).head(n).to_dict("records")
    else:
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()][:n]
    if len(rows) < n or not all("question" in r and "answer" in r for r in rows):
        raise ValueError(f"tailorkv_layers: {path} must hold >= {n} records with `question` and `answer` fields")
    return [(r["question"], r["answer"]) for r in rows]
