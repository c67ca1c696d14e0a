"""KVzip+ (`kvzip kvzip_plus=true`) against an independent recomputation: tests/unit/test_kvzip.py's eager reference
(context + each reconstruction input in one forward, rows renormalised over the keys KVzip's softmax sees), each
row's probabilities divided by the norm of that row's attention input (read by a hook on the attention module) and
each entry's multiplied by ‖v W_o,h‖ computed directly (v times query head h's block of W_o), as the KVzap paper
and kvpress's `kvzip_plus_normalization` define it."""
from __future__ import annotations

import torch

import kvbench.methods  # noqa: F401
from kvbench.engine.generation import prepare
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from tests.unit.test_kvzip import BUDGET, CHUNK, N, POSTFIX, PROMPT_IDS, SINK, kept_positions, peaked_model
from tests.unit.tiny import prompt, tiny_model


@torch.no_grad()
def reference_plus_scores(model, ids: torch.Tensor) -> torch.Tensor:
    """KVzip+ scores `[L, H_kv, n]` (sinks at +inf) by eager attention, hooks and a direct v W_o."""
    n, n_heads, n_kv = ids.shape[1], model.config.num_attention_heads, model.config.num_key_value_heads
    layers = model.model.layers
    scores = torch.zeros(len(layers), n_kv, n)
    inputs = {}
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda module, args, kwargs: inputs.__setitem__(module.layer_idx, kwargs["hidden_states"]), with_kwargs=True)
        for layer in layers]
    first, following, suffix = (torch.tensor(x) for x in PROMPT_IDS)
    try:
        for start in range(SINK, n, CHUNK):
            end = min(start + CHUNK, n)
            quoted = first if start == SINK else torch.cat([following, ids[0, start - POSTFIX:start]])
            repeat = torch.cat([quoted, suffix, ids[0, start:end]]).long()
            m = repeat.shape[0]
            out = model(torch.cat([ids[0], repeat])[None], output_attentions=True, use_cache=True)
            seen = torch.zeros(n + m, dtype=torch.bool)
            seen[:SINK] = seen[start:end] = seen[n:] = True
            for layer, probs in enumerate(out.attentions):
                rows = probs[0, :, n:].double()
                rows = rows * seen / (rows * seen).sum(-1, keepdim=True)  # [H_q, m, n + m]
                rows = rows / inputs[layer][0, n:].double().norm(dim=-1)[None, :, None]
                values = out.past_key_values.layers[layer].values[0].double()  # [H_kv, n + m, D]
                w_o = layers[layer].self_attn.o_proj.weight.double()  # [hidden, H_q * D]
                d = values.shape[-1]
                for h in range(n_heads):
                    written = values[h // (n_heads // n_kv)] @ w_o[:, h * d:(h + 1) * d].T  # [n + m, hidden]
                    rows[h] = rows[h] * written.norm(dim=-1)[None]
                per_kv = rows[..., start:end].amax(dim=1).view(n_kv, n_heads // n_kv, -1).amax(dim=1)
                scores[layer, :, start:end] = per_kv.float()
    finally:
        for hook in hooks:
            hook.remove()
    scores[..., :SINK] = float("inf")
    return scores


def test_kvzip_plus_keeps_the_recomputed_global_top_entries():
    model, ids = peaked_model(), prompt(N)
    kept = {}
    for plus in (False, True):
        method = METHODS["kvzip"](chunk_size=CHUNK, prompt_ids=PROMPT_IDS, kvzip_plus=plus)
        with AttentionCapture(model) as capture:
            cache = prepare(model, method, capture, ids, BUDGET, 1).cache
            kept[plus] = [kept_positions(layer) for layer in cache.layers]
    eager = tiny_model("llama", layers=2, attn="eager")
    eager.load_state_dict(model.state_dict())
    scores = reference_plus_scores(eager, ids)
    n_layers, n_kv = scores.shape[:2]
    cut = scores.flatten().topk(BUDGET * n_layers * n_kv).values[-1]
    eps = 1e-5 * float(cut)
    assert kept[True] != kept[False]  # the normalisation changes the selection
    for layer in range(n_layers):
        for head in range(n_kv):
            mask = torch.zeros(N, dtype=torch.bool)
            mask[kept[True][layer][head]] = True
            s = scores[layer, head]
            assert bool(mask[s > cut + eps].all()) and not bool(mask[s < cut - eps].any()), (layer, head)
