"""Beam search over a compressed cache (`generation.num_beams`; Keyformer's tables decode with 4 beams).

Beams are one sequence of the engine's step whose cache has one row per beam: the prompt is prefilled and
compressed once, exactly as for greedy decoding (`generation.prepare`); the compressed cache is then repeated along
the batch dimension, so all beams start from the same kept entries. `BeamSearch` is that sequence's token rule: each
step it picks the beams that survive, gathers every cache layer's keys, values and positions by beam, and the
decode-time method's per-beam state (H2O/Keyformer/BUZZ accumulated scores, `EvictionState.scores`), so a beam
continues with its parent's cache and history, and returns one token per beam for the step's forward
(`kvbench.engine.batching`, which runs the model). Decode-time eviction then runs per beam row (the methods select per
batch row). State that is not per beam stays shared: Keyformer's noise generator draws fresh noise for every element
each step, and BUZZ's old-sample count depends only on the step count. Keyformer's code summed scores over beams and
shared one mask (d-matrix-ai/keyformer-llm @f327831, `gumbel.sum(0).sum(1)`); here each beam keeps its own history.

The search follows transformers' `_beam_search` (v5.23, batch of one) step for step: the top
`max(2, 1 + n_eos) * num_beams` continuations of all beams by summed log-probability; among them, those ending in EOS
(or reaching `max_new_tokens`) and ranked within the first `num_beams` become finished hypotheses scored
`sum_logprobs / generated_len ** length_penalty`; the best `num_beams` unfinished ones continue; generation stops when
no running beam can beat the worst finished one (`early_stopping=False`), when `num_beams` hypotheses are finished
(`early_stopping=True`), or at `max_new_tokens`. The best finished hypothesis is returned. With `num_beams=1` this
is greedy search. Dense caches only (not Ada-KV's per-head lengths, not TailorKV's offloaded layers).
"""
from __future__ import annotations

import torch
from torch import Tensor

from kvbench.cache import KVCache
from kvbench.engine.batching import BatchedDecoder, Request, run_alone
from kvbench.engine.generation import Generation, Prepared, eos_token_ids, prepare
from kvbench.methods.base import Kind, Method
from kvbench.methods.decoding import EvictionState
from kvbench.models.capture import AttentionCapture

NEG = -1.0e9  # transformers' "impossible" score


def reorder(cache: KVCache, beam_idx: Tensor, state: EvictionState | None) -> None:
    """Gather every layer's rows (and the method's per-beam scores) by `beam_idx` `[num_beams]`."""
    for layer in cache.layers:
        if layer.own_storage:
            raise ValueError("beam search needs a dense cache; per-head variable (adakv) or offloaded/quantized "
                             "(tailorkv) layers cannot be reordered by beam")
        layer.keys = layer.keys.index_select(0, beam_idx)
        layer.values = layer.values.index_select(0, beam_idx)
        layer.positions = layer.positions.index_select(0, beam_idx)
    cache.states.reorder(beam_idx)  # a hybrid's recurrent state follows its beam (transformers' reorder_cache)
    if state is not None:
        for i, scores in state.scores.items():
            state.scores[i] = scores.index_select(0, beam_idx)


class BeamSearch:
    """The token rule of a beam sequence: `choose` takes the step's logits `[num_beams, V]` (or the prompt's
    `[1, V]`), reorders the cache by surviving beam and returns the next token of every beam `[num_beams, 1]`, or
    None once the search has ended; `best` is then the best finished hypothesis."""

    def __init__(self, num_beams: int, eos_ids: set[int], max_new_tokens: int, length_penalty: float = 1.0,
                 early_stopping: bool = False):
        if num_beams < 1:
            raise ValueError(f"generation: num_beams={num_beams} must be >= 1")
        self.num_beams, self.max_new_tokens = num_beams, max_new_tokens
        self.length_penalty, self.early_stopping = length_penalty, early_stopping
        self.eos_ids, self.n_keep = set(eos_ids), max(2, 1 + len(eos_ids)) * num_beams
        self.running: list[list[int]] = [[] for _ in range(num_beams)]
        self.finished: list[list[int]] = [[] for _ in range(num_beams)]
        self.running_scores = self.finished_scores = self.finished_flags = None
        self.can_improve = True

    def best(self) -> list[int]:
        return [tok for tok in self.finished[0] if tok not in self.eos_ids]

    def choose(self, logits: Tensor, t: int, run: Prepared) -> Tensor | None:
        device, k = logits.device, self.num_beams
        if t == 0:  # every beam starts as the prompt; only the first has a score
            reorder(run.cache, torch.zeros(k, dtype=torch.long, device=device), run.state)
            self.running_scores = torch.full((k,), NEG, device=device)
            self.running_scores[0] = 0.0
            self.finished_scores = torch.full((k,), NEG, device=device)
            self.finished_flags = torch.zeros(k, dtype=torch.bool, device=device)
        logits = logits.expand(k, -1)
        log_probs = logits.float().log_softmax(dim=-1) + self.running_scores[:, None]
        vocab = log_probs.shape[-1]
        cand_scores, cand = log_probs.reshape(-1).topk(self.n_keep)
        cand_beam, cand_token = cand // vocab, cand % vocab
        eos = torch.tensor(sorted(self.eos_ids), device=device, dtype=torch.long)
        hits = torch.isin(cand_token, eos) | (t + 1 == self.max_new_tokens)
        top_mask = torch.arange(self.n_keep, device=device) < k
        # finished hypotheses: top-num_beams candidates that just ended, if they can still enter the list
        final = cand_scores / ((t + 1) ** self.length_penalty)
        final = final + NEG * (bool(self.finished_flags.all()) and self.early_stopping) + NEG * (not self.can_improve)
        final = final + NEG * ~(hits & top_mask)
        merged = torch.cat([self.finished_scores, final])
        best = merged.topk(k).indices.tolist()
        pool = self.finished + [self.running[b] + [tok] for b, tok in zip(cand_beam.tolist(), cand_token.tolist())]
        flags = torch.cat([self.finished_flags, hits & top_mask])
        self.finished = [pool[i] for i in best]
        self.finished_scores, self.finished_flags = merged[best], flags[best]
        # running beams for the next step: the best candidates that did not end
        alive_scores = cand_scores + NEG * hits.float()
        nxt = alive_scores.topk(k).indices
        self.running = [self.running[b] + [tok] for b, tok in zip(cand_beam[nxt].tolist(), cand_token[nxt].tolist())]
        self.running_scores = alive_scores[nxt]
        best_possible = self.running_scores[0] / ((t + 1) ** self.length_penalty)
        worst = torch.where(self.finished_flags, self.finished_scores.min(), torch.tensor(NEG, device=device))
        self.can_improve = self.can_improve and bool((best_possible > worst).any())
        if not self.can_improve or (self.early_stopping and bool(self.finished_flags.all())) or bool(hits.all()):
            return None
        reorder(run.cache, cand_beam[nxt], run.state)
        return cand_token[nxt][:, None]


@torch.no_grad()
def beam_generate(model, tokenizer, method: Method, capture: AttentionCapture, input_ids: Tensor,
                  budget: int | None, max_new_tokens: int, num_beams: int, eos_ids: set[int] | None = None,
                  length_penalty: float = 1.0, early_stopping: bool = False, positions: str = "original",
                  seed: int = 0) -> Generation:
    """Beam search from one prompt `[1, L]` through the engine's step; see the module docstring. Returns the best
    hypothesis; KV bytes are per beam."""
    if num_beams < 1:
        raise ValueError(f"generation: num_beams={num_beams} must be >= 1")
    if method.kind is Kind.STORAGE:
        raise ValueError(f"beam search needs a dense cache; {method.registry_name} rebuilds its own layers")
    eos_ids = eos_token_ids(model, tokenizer) if eos_ids is None else eos_ids
    prep = prepare(model, method, capture, input_ids, budget, max_new_tokens, positions, seed)
    search = BeamSearch(num_beams, eos_ids, max_new_tokens, length_penalty, early_stopping)
    request = Request(None, None, max_new_tokens, prepared=prep, beams=search)
    gen = run_alone(BatchedDecoder(model, tokenizer, method, capture, 1, positions=positions, eos_ids=eos_ids),
                    request)
    gen.kv_bytes_final = prep.cache.nbytes() // num_beams  # per beam
    gen.kv_bytes_per_layer_final = [layer.nbytes() // num_beams for layer in prep.cache.layers]
    gen.timings["num_beams"] = num_beams
    return gen
