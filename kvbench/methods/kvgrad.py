r"""KVgrad (OpenReview cg1wTCJjjk): KVzip's context replay, each entry weighed by input x gradient attribution.
Reference code: NVIDIA/kvpress 0.5.5 `kvpress/presses/kvgrad_press.py: KVgradPress` (the only released code).

KVzip's replay (kvbench/methods/kvzip.py: the "repeat the previous context" inputs, chunk by chunk, on top of the
full cache) runs with autograd (`kvbench.engine.gradient_replay`): Phi = sum over the replay's tokens of ||h||^2,
h the last decoder layer's output (before the final norm), is differentiated with respect to every layer's attention
output a_p (what that layer writes into the residual stream at replay token p). Entry c of layer l then scores

    S_{l,c} = max over the group's query heads and the rows p of  A_{p,c} x ||v_c W_O^h||_2 x ||dPhi / da_p||_2

with A KVzip's replay attention (softmax over the sinks, the chunk and the input itself), W_O^h query head h's
block of the output projection; one top-k over all layers and heads keeps `budget x layers x heads` entries, the
sinks always (KVzip's `select_all`: heads stored with different lengths).

Defaults are kvpress's: chunks of 512 context tokens, its later-chunk prompt (no trailing space after "starting
with"), `n_sink=4`. Sinks as kvbench's KVzip (`sinks=apart`: the first `n_sink` entries are never replayed and sit in
every softmax; kvpress with a chat template: its template prefix); `sinks=repeated` is kvpress without a chat
template, equal to KVgradPress's kept sets on the embedded model (tests/unit/test_kvgrad.py). Scores in fp32
(kvpress: the model dtype). Parameters are never given gradients (only the activations are differentiated).
Cost: per chunk one forward with autograd and one backward (kvpress: "3-4 times the initial prefilling"), the
chunk's activations held for the backward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from kvbench.methods.kvzip import FIRST_PROMPT, NEXT_PROMPT, KVzip, chat_suffix, value_output_norm
from kvbench.registry import METHODS


@METHODS.register("kvgrad")
@dataclass
class KVgrad(KVzip):
    replay_gradient: ClassVar[bool] = True  # the engine replays with autograd and hands `gradient_scores` the rest

    chunk_size: int = 512

    def __post_init__(self):
        super().__post_init__()
        if self.kvzip_plus:
            raise ValueError("kvgrad: kvzip_plus is KVzip's switch; KVgrad weighs entries by its gradients instead")

    def prepare(self, model, tokenizer, *, prefill=None) -> dict | None:
        """kvpress's prompts (its later-chunk prompt has no trailing space) and KVzip's suffix rule."""
        if self.prompt_ids is None:
            self._suffix_text = chat_suffix(tokenizer) if self.chat_template else "\n"
            self.prompt_ids = [tokenizer.encode(text, add_special_tokens=False)
                               for text in (FIRST_PROMPT, NEXT_PROMPT.rstrip(" "), self._suffix_text)]
        return {"reconstruction_suffix": self._suffix_text} if self._suffix_text else None

    def gradient_scores(self, query: Tensor, key: Tensor, scaling: float, start: int, end: int,
                        softcap: float | None, grad_norm: Tensor, values: Tensor, output_weight: Tensor) -> Tensor:
        """`[B, H_kv, end - start]`: max over the group's heads and the rows of A x ||v W_O^h|| x ||dPhi/da||, A
        KVzip's `chunk_probs` of query `[B, H_q, q, D]` over key `[B, H_kv, n + q, D]`; grad_norm `[B, q]`;
        values `[B, H_kv, end - start, D]` (the chunk's); output_weight W_O `[hidden, H_q * D]`."""
        (b, h_q), h_kv = query.shape[:2], key.shape[1]
        value_norm = value_output_norm(values, output_weight, h_q).unsqueeze(3)  # [B, H_kv, G, 1, c]
        best = value_norm.new_full((b, h_kv, end - start), float("-inf"))
        for row, probs in self.chunk_probs(query, key, scaling, start, end, softcap):
            weighted = probs * value_norm * grad_norm[:, None, None, row:row + probs.shape[3], None].float()
            best = torch.maximum(best, weighted.amax(dim=(2, 3)))
        return best
