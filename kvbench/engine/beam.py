"""Beam search over a compressed cache (`generation.num_beams`; Keyformer's tables decode with 4 beams).

The prompt is prefilled and compressed once, exactly as for greedy decoding (`generation.prepare`);
the compressed cache is then repeated along the batch dimension, one row per beam, so all beams start from the same
kept entries. After each step the beams that survive are gathered by index: every cache layer's keys, values and
positions, and the decode-time method's per-beam state (H2O/Keyformer/BUZZ accumulated scores, `EvictionState.
scores`), so a beam continues with its parent's cache and history. Decode-time eviction then runs per beam row
(the methods select per batch row). State that is not per beam stays shared: Keyformer's noise generator draws fresh
noise for every element each step, and BUZZ's old-sample count depends only on the step count. Keyformer's code
summed scores over beams and shared one mask (specs/seed-keyformer.md §1.4); here each beam keeps its own history.

The search itself follows transformers' `_beam_search` (v5.23, batch of one) step for step: the top
`max(2, 1 + n_eos) * num_beams` continuations of all beams by summed log-probability; among them, those ending in EOS
(or reaching `max_new_tokens`) and ranked within the first `num_beams` become finished hypotheses scored
`sum_logprobs / generated_len ** length_penalty`; the best `num_beams` unfinished ones continue; generation stops when
no running beam can beat the worst finished one (`early_stopping=False`), when `num_beams` hypotheses are finished
(`early_stopping=True`), or at `max_new_tokens`. The best finished hypothesis is returned. With `num_beams=1` this
is greedy search. Dense caches only (not Ada-KV's per-head lengths, not TailorKV's offloaded layers).
"""
from __future__ import annotations

import time

import torch
from torch import Tensor

from kvbench.cache import KVCache
from kvbench.engine.generation import Generation, eos_token_ids, prepare
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
    if state is not None:
        for i, scores in state.scores.items():
            state.scores[i] = scores.index_select(0, beam_idx)


@torch.no_grad()
def beam_generate(model, tokenizer, method: Method, capture: AttentionCapture, input_ids: Tensor,
                  budget: int | None, max_new_tokens: int, num_beams: int, eos_ids: set[int] | None = None,
                  length_penalty: float = 1.0, early_stopping: bool = False, positions: str = "original",
                  seed: int = 0) -> Generation:
    """Beam search from one prompt `[1, L]`; see the module docstring. Returns the best hypothesis."""
    if num_beams < 1:
        raise ValueError(f"generation: num_beams={num_beams} must be >= 1")
    if method.kind is Kind.STORAGE:
        raise ValueError(f"beam search needs a dense cache; {method.registry_name} rebuilds its own layers")
    eos_ids = eos_token_ids(model, tokenizer) if eos_ids is None else eos_ids
    device = input_ids.device
    prep = prepare(model, method, capture, input_ids, budget, max_new_tokens, positions, seed)
    cache, state, prompt_len, logits = prep.cache, prep.state, prep.prompt_len, prep.logits
    t2 = time.perf_counter()
    reorder(cache, torch.zeros(num_beams, dtype=torch.long, device=device), state)  # every beam = the prompt
    logits = logits.expand(num_beams, -1)

    n_keep = max(2, 1 + len(eos_ids)) * num_beams
    eos = torch.tensor(sorted(eos_ids), device=device, dtype=torch.long)
    running = [[] for _ in range(num_beams)]
    running_scores = torch.full((num_beams,), NEG, device=device)
    running_scores[0] = 0.0
    finished: list[list[int]] = [[] for _ in range(num_beams)]
    finished_scores = torch.full((num_beams,), NEG, device=device)
    finished_flags = torch.zeros(num_beams, dtype=torch.bool, device=device)
    top_mask = torch.arange(n_keep, device=device) < num_beams
    can_improve, n_forward = True, 0
    for t in range(max_new_tokens):
        log_probs = logits.float().log_softmax(dim=-1) + running_scores[:, None]
        vocab = log_probs.shape[-1]
        cand_scores, cand = log_probs.reshape(-1).topk(n_keep)
        cand_beam, cand_token = cand // vocab, cand % vocab
        hits = torch.isin(cand_token, eos) | (t + 1 == max_new_tokens)
        # finished hypotheses: top-num_beams candidates that just ended, if they can still enter the list
        final = cand_scores / ((t + 1) ** length_penalty)
        final = final + NEG * (bool(finished_flags.all()) and early_stopping) + NEG * (not can_improve)
        final = final + NEG * ~(hits & top_mask)
        merged = torch.cat([finished_scores, final])
        best = merged.topk(num_beams).indices.tolist()
        pool = finished + [running[b] + [tok] for b, tok in zip(cand_beam.tolist(), cand_token.tolist())]
        flags = torch.cat([finished_flags, hits & top_mask])
        finished = [pool[i] for i in best]
        finished_scores, finished_flags = merged[best], flags[best]
        # running beams for the next step: the best candidates that did not end
        alive_scores = cand_scores + NEG * hits.float()
        nxt = alive_scores.topk(num_beams).indices
        running = [running[b] + [tok] for b, tok in zip(cand_beam[nxt].tolist(), cand_token[nxt].tolist())]
        running_scores = alive_scores[nxt]
        best_possible = running_scores[0] / ((t + 1) ** length_penalty)
        worst = torch.where(finished_flags, finished_scores.min(), torch.tensor(NEG, device=device))
        can_improve = can_improve and bool((best_possible > worst).any())
        if not can_improve or (early_stopping and bool(finished_flags.all())) or bool(hits.all()):
            break
        reorder(cache, cand_beam[nxt], state)
        if positions == "shift":
            slot = cache.layers[0].keys.shape[-2]
            for layer in cache.layers:
                layer.next_position = slot
            pos = torch.full((num_beams, 1), slot, device=device)
        else:
            pos = torch.full((num_beams, 1), prompt_len + t, device=device)
        tokens = cand_token[nxt][:, None]
        logits = model(input_ids=tokens, past_key_values=cache, position_ids=pos, use_cache=True).logits[:, -1]
        n_forward += 1
    capture.reset()
    t3 = time.perf_counter()
    tokens = [tok for tok in finished[0] if tok not in eos_ids]
    text = tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer is not None else ""
    gen = prep.finish(tokens, text, n_forward, t3 - t2)
    gen.kv_bytes_final = cache.nbytes() // num_beams  # per beam
    gen.kv_bytes_per_layer_final = [layer.nbytes() // num_beams for layer in cache.layers]
    gen.timings["num_beams"] = num_beams
    return gen
