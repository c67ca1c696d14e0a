r"""KVzip (Kim et al., arXiv 2505.23416): question-agnostic importance from a context-reconstruction pass.
Reference code: snu-mllab/KVzip @ 5d84729 (`model/wrapper.py: ModelKVzip.self_task/scoring`, `attention/score.py:
KVScore._get_score/_threshold`) and NVIDIA/kvpress @ 8bb29b9 (`kvpress/presses/kvzip_press.py: KVzipPress`).

The model is asked to repeat its context, and an entry matters as much as the repetition attends to it:
1. after the prefill, the context (minus its first `n_sink` entries) is cut into chunks of `chunk_size` tokens;
   chunk i's reconstruction input is `"\n\nRepeat the previous context exactly."` (i = 0) or `"\n\nRepeat the part
   of the previous context exactly, starting with "` + the previous chunk's last `prev_postfix_size` tokens (i > 0),
   then the chat template's end of user turn + assistant header (`suffix`), then the chunk's own tokens;
2. each input is prefilled on top of the FULL context cache at the positions right after the context (every chunk
   at the same positions: its K/V is dropped before the next); the engine does this (`generation.reconstruct`);
3. in every layer, each row of the input (prompt, suffix and chunk rows alike) takes a softmax over the keys of the
   sinks, the chunk and the input itself (causal among those); an entry of the chunk scores the maximum
   probability any row of any query head of its KV group gives it (`chunk_scores`);
4. one top-k over all layers and KV heads keeps `budget x layers x heads` entries, the sinks always among them
   (`select_all`): heads and layers keep different lengths, stored per head (`kvbench.cache.varlen`, Ada-KV's).

Defaults: `chunk_size=2000` and the prompts with the trailing space are the authors' (`self_task`; kvpress: 2048,
no trailing space); `prev_postfix_size=8` (both); `n_sink=4` (kvpress); no recent window is protected (neither
protects one: "KVzip does not rely on safeguards"); pair-level selection across layers (the authors' default
`level=pair`, kvpress `layerwise=False`).

Where kvbench differs, and why:
- Sinks. The authors' sink is the system prompt of their own template (kept, never repeated, keys in the softmax);
  kvpress keeps the first `n_sink` tokens of the chat template's prefix and repeats the rest of the prompt.
  kvbench's prompt has no separate system prompt, so its first `n_sink` entries play that part: kept, in every
  softmax, not repeated; the chunks cover the rest. Sinks count inside the budget (kvbench's budget semantics).
  `sinks="repeated"` is kvpress on a tokenizer without a chat template (no prefix): the repeat starts at position
  0, so the first chunk's softmax has no sink keys and the sinks are scored like any entry (still always kept);
  with it and `chunk_size=2048` the kept entries equal KVzipPress's (tests/unit/test_kvpress_oracle.py; one-chunk
  prompts: kvpress's later-chunk prompt also lacks the authors' trailing space, kvbench keeps it).
- Budget. `budget=B` keeps exactly B x layers x KV heads entries (mean B per head; a head may keep only its sinks
  or everything). The authors keep the entries strictly above the (ratio x N)-th score, kvpress drops exactly
  int(ratio x N); `ratio=r` maps to a budget like for every method.
- Suffix. With `model.chat_template: true` it is read from the tokenizer's template as kvpress does (render a
  dummy user turn, take what follows the content); without a chat template it is kvpress's `"\n"` (the authors'
  table has per-model templates and `"\n\nAnswer: "` for unknown ones). Under `query=aware` the whole prompt is the
  context: the reconstruction then follows the question (and any assistant header) rather than the user turn.
- Precision: scores in fp32 (the authors: model dtype; kvpress: model dtype); queries in blocks of 512 rows.
- KVzip+ (`kvzip_plus=true`; kvpress `KVzipPress(kvzip_plus_normalization=True)`, the KVzap paper arXiv 2601.07891,
  Sec. 2): each row's probabilities are divided by the norm of that row's attention input (post-norm hidden state)
  and each entry's by query head h's ‖v W_o,h‖ (what the entry writes into the residual stream), before the max.
  ‖v W_o,h‖ is computed as sqrt(vᵀ (W_o,hᵀ W_o,h) v) (kvpress materialises v W_o: entries x hidden per query head).
- Not implemented: head-level (`level=head`) scores,
  uniform per-head budgets (`pair-uniform`), Gemma 3's hybrid cache (its sliding-window layers are kept whole here)
  and ALiBi models (refused by the capture).
Cost: one more prefill of about the context's length over twice the context (kvpress: "2-3 times the initial
prefilling"); on the embedded model (NIAH 1000-1500 tokens, CPU, one thread) `compress_s` was about 4x `prefill_s`,
and the K/V held at the peak 2x the full cache (the reconstruction's K/V on top of the context's).
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterator
from typing import ClassVar, Literal

import torch
from torch import Tensor

from kvbench.methods.base import Kind, Method
from kvbench.registry import METHODS

FIRST_PROMPT = "\n\nRepeat the previous context exactly."
NEXT_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with "


def chat_suffix(tokenizer) -> str:
    """What a chat template puts after a user turn's content, generation prompt included (kvpress's rule)."""
    dummy = "dummy context"
    separator = "\n" + "#" * len(dummy)
    text = tokenizer.apply_chat_template([{"role": "user", "content": dummy + separator}], add_generation_prompt=True,
                                         tokenize=False, enable_thinking=False)
    return text.split(separator)[1]


@METHODS.register("kvzip")
@dataclass
class KVzip(Method):
    kind: ClassVar[Kind] = Kind.RECONSTRUCTOR
    own_storage: ClassVar[bool] = True  # per-head variable layers

    chunk_size: int = 2000  # context tokens repeated per reconstruction prefill
    prev_postfix_size: int = 8  # the previous chunk's last tokens, quoted in the next prompt
    n_sink: int = 4  # first entries: always kept, in every score's softmax, never repeated; inside the budget
    sinks: Literal["apart", "repeated"] = "apart"  # repeated: kvpress without a chat template (repeat from 0)
    chat_template: bool = False  # the model config's: the suffix comes from the tokenizer's chat template
    kvzip_plus: bool = False  # KVzip+: scores / ‖row input‖ x ‖v W_o‖ (kvpress kvzip_plus_normalization)
    prompt_ids: list | None = None  # [first prompt, next prompt, suffix] token ids; None: `prepare` tokenizes them
    row_block: ClassVar[int] = 512  # query rows scored at once (memory rows x keys per head)

    def __post_init__(self):
        self._suffix_text = ""  # what `prepare` read from the chat template, for the manifest
        if self.chunk_size < 1:
            raise ValueError(f"kvzip: chunk_size={self.chunk_size} must be >= 1")
        if self.prev_postfix_size < 0 or self.n_sink < 0:
            raise ValueError(f"kvzip: prev_postfix_size={self.prev_postfix_size} and n_sink={self.n_sink} must "
                             "be >= 0")
        if self.sinks not in ("apart", "repeated"):
            raise ValueError(f"kvzip: sinks={self.sinks!r} is not one of apart, repeated")
        if self.prompt_ids is not None and (len(self.prompt_ids) != 3 or not all(self.prompt_ids[:2])):
            raise ValueError(f"kvzip: prompt_ids={self.prompt_ids!r} must be [first prompt ids, next prompt ids, "
                             "suffix ids] (the prompts non-empty), or null to tokenize them")

    def check_budget(self, budget: int | None) -> None:
        super().check_budget(budget)
        if budget <= self.n_sink:
            raise ValueError(f"kvzip: budget={budget} must be > n_sink={self.n_sink} (sinks count inside the "
                             "budget); raise budget or lower method.n_sink.")

    def prepare(self, model, tokenizer, *, prefill=None) -> dict | None:
        """Tokenize the reconstruction prompts and the suffix once per run (unless `prompt_ids` were given)."""
        if self.prompt_ids is None:
            self._suffix_text = chat_suffix(tokenizer) if self.chat_template else "\n"
            self.prompt_ids = [tokenizer.encode(text, add_special_tokens=False)
                               for text in (FIRST_PROMPT, NEXT_PROMPT, self._suffix_text)]
        return {"reconstruction_suffix": self._suffix_text} if self._suffix_text else None

    def reconstruction_inputs(self, context_ids: Tensor) -> list[tuple[int, int, Tensor]]:
        """`(start, end, ids [1, m])` per chunk: the context positions [start, end) it repeats and its input."""
        if self.prompt_ids is None:
            raise ValueError("kvzip: the reconstruction prompt is not tokenized; call method.prepare(model, "
                             "tokenizer) first (or set method.prompt_ids)")
        first, following, suffix = (torch.tensor(ids, dtype=context_ids.dtype, device=context_ids.device)
                                    for ids in self.prompt_ids)
        ids, n = context_ids[0], context_ids.shape[1]
        starts = range(0 if self.sinks == "repeated" else min(self.n_sink, n), n, self.chunk_size)
        inputs = []
        for start in starts:
            end = min(start + self.chunk_size, n)
            prompt = first if start == starts[0] else torch.cat(
                [following, ids[max(start - self.prev_postfix_size, start - self.chunk_size):start]])
            inputs.append((start, end, torch.cat([prompt, suffix, ids[start:end]])[None]))
        return inputs

    def chunk_probs(self, query: Tensor, key: Tensor, scaling: float, start: int, end: int,
                    softcap: float | None = None) -> Iterator[tuple[int, Tensor]]:
        """(first row, probs `[B, H_kv, G, r, end - start]`) per block of `row_block` reconstruction rows: each row
        of `query` `[B, H_q, q, D]` takes a softmax over the sinks, the chunk [start, end) and the input itself
        (causal) among `key` `[B, H_kv, n + q, D]` (the layer's context, then the input's own keys), fp32, sliced
        to the chunk's entries; G = the query heads of a KV group."""
        b, h_q, q, d = query.shape
        h_kv = key.shape[1]
        sink = min(self.n_sink, start)
        keys = torch.cat([key[:, :, :sink], key[:, :, start:end], key[:, :, -q:]], dim=2).float()
        grouped = query.float().view(b, h_kv, h_q // h_kv, q, d)
        for row in range(0, q, self.row_block):
            rows = grouped[:, :, :, row:row + self.row_block]
            logits = rows @ keys[:, :, None].transpose(-1, -2) * scaling  # [B, H_kv, G, r, m]
            if softcap is not None:
                logits = softcap * torch.tanh(logits / softcap)
            r = rows.shape[3]
            future = torch.arange(q, device=key.device)[None] > torch.arange(row, row + r, device=key.device)[:, None]
            logits[..., keys.shape[2] - q:] = logits[..., keys.shape[2] - q:].masked_fill(future, float("-inf"))
            yield row, logits.softmax(dim=-1)[..., sink:sink + end - start]

    def chunk_scores(self, query: Tensor, key: Tensor, scaling: float, start: int, end: int,
                     softcap: float | None = None, value: Tensor | None = None, hidden: Tensor | None = None,
                     output_weight: Tensor | None = None) -> Tensor:
        """Max attention `[B, H_kv, end - start]` that the reconstruction rows pay each context entry in
        [start, end) (`chunk_probs`): max over the group's heads and the rows. KVzip+ weighs each row by
        1 / its attention input's norm and each entry by its ‖v W_o‖, so it also needs `value` (as `key`), the rows'
        attention input `hidden` `[B, q, hidden]` and W_o."""
        row_weight = col_weight = None
        if self.kvzip_plus:
            if value is None or hidden is None or output_weight is None:
                raise ValueError("kvzip: kvzip_plus=true needs the values, the rows' attention input and W_o")
            row_weight = 1 / hidden.float().norm(dim=-1)[:, None, None]  # [B, 1, 1, q]
            col_weight = value_output_norm(value[:, :, start:end], output_weight, query.shape[1])[..., None, :]
        best = query.new_full((query.shape[0], key.shape[1], end - start), float("-inf"), dtype=torch.float32)
        for row, probs in self.chunk_probs(query, key, scaling, start, end, softcap):
            if row_weight is not None:
                probs = probs * row_weight[:, :, :, row:row + probs.shape[3], None] * col_weight
            best = torch.maximum(best, probs.amax(dim=(2, 3)))
        return best

    def select_all(self, scores: dict[int, Tensor], budget: int) -> dict[int, list[Tensor]]:
        """One top-(budget x layers x heads) over every scored layer's `[1, H_kv, n]` scores, the first `n_sink`
        entries forced in: per layer, one sorted index tensor per KV head. Empty when everything fits."""
        if not scores:
            return {}
        layers = sorted(scores)
        stacked = torch.stack([scores[i][0] for i in layers])  # [L, H, n]
        if scores[layers[0]].shape[0] != 1:
            raise ValueError("kvzip: per-head variable budgets need batch size 1")
        n_layers, n_heads, n = stacked.shape
        total = budget * n_layers * n_heads
        if total >= stacked.numel():
            return {}
        stacked = stacked.clone()
        stacked[..., :self.n_sink] = float("inf")
        keep = torch.zeros(stacked.numel(), dtype=torch.bool, device=stacked.device)
        keep[stacked.flatten().topk(total).indices] = True
        keep = keep.view(n_layers, n_heads, n)
        return {i: [head.nonzero().flatten() for head in keep[k]] for k, i in enumerate(layers)}


def value_output_norm(values: Tensor, output_weight: Tensor, n_heads: int) -> Tensor:
    """‖v W_o,h‖ per query head h and entry: `[B, H_kv, G, T]` from `values` `[B, H_kv, T, D]` and W_o `[hidden,
    H_q * D]` (column block h: query head h), as sqrt(vᵀ (W_o,hᵀ W_o,h) v): never entries x hidden per head."""
    b, h_kv, t, d = values.shape
    weight = output_weight.float().view(-1, h_kv, n_heads // h_kv, d)  # [hidden, H_kv, G, D]
    gram = torch.einsum("jhgi,jhgk->hgik", weight, weight)  # [H_kv, G, D, D]
    v = values.float()
    return torch.einsum("bhti,hgik,bhtk->bhgt", v, gram, v).clamp_min(0).sqrt()
