"""KVgrad (kvbench/methods/kvgrad.py, kvbench/engine/gradient_replay.py) against an independent recomputation.

The reference runs, per replay input, ONE eager forward of the plain transformers model over context + input with
autograd from the embeddings (`output_attentions=True`), so the input sits right after the context as in the replay;
it differentiates sum ||h||^2 over the input's rows of the last decoder layer's output with respect to each layer's
attention output, renormalizes each input row's attention over the keys KVzip's softmax sees, weighs it by
||v W_O^h|| (values from transformers' own cache) and by the row's gradient norm, takes the max over the group and
rows, and picks one top-k over all layers and heads, sinks forced. kvbench must keep exactly those entries (up to
near-ties at the cut), give no weight a gradient, and leave no graph in the cache. Against kvpress's own kept sets:
tests/unit/test_kvpress_scorers3.py."""
from __future__ import annotations

import torch
from transformers import DynamicCache

import kvbench.methods  # noqa: F401
from kvbench.engine.generation import prepare
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from tests.unit.test_kvzip import PROMPT_IDS, kept_positions, peaked_model
from tests.unit.tiny import prompt, tiny_model

N, BUDGET, CHUNK, SINK = 100, 30, 48, 4


def reference_scores(model, method, ids) -> torch.Tensor:
    eager = tiny_model("llama", layers=2, attn="eager")
    eager.load_state_dict(model.state_dict())
    eager.requires_grad_(False)
    cfg = eager.config
    n, h_q, h_kv = ids.shape[1], cfg.num_attention_heads, cfg.num_key_value_heads
    d, g = cfg.hidden_size // h_q, h_q // h_kv
    scores = torch.zeros(cfg.num_hidden_layers, h_kv, n)
    for start, end, repeat in method.reconstruction_inputs(ids):
        m = repeat.shape[1]
        outs, hooks = {}, []
        for i, layer in enumerate(eager.model.layers):
            hooks.append(layer.self_attn.register_forward_hook(lambda mod, a, o, i=i: outs.__setitem__(i, o[0])))
        hooks.append(eager.model.layers[-1].register_forward_hook(lambda mod, a, o: outs.__setitem__("h", o)))
        cache = DynamicCache()
        embeds = eager.model.embed_tokens(torch.cat([ids, repeat], dim=1)).detach().requires_grad_(True)
        out = eager(inputs_embeds=embeds, past_key_values=cache, output_attentions=True)
        for hook in hooks:
            hook.remove()
        phi = outs["h"][0, n:].square().sum()
        grads = torch.autograd.grad(phi, [outs[i] for i in range(cfg.num_hidden_layers)])
        seen = torch.zeros(n + m, dtype=torch.bool)
        seen[:min(SINK, start)] = seen[start:end] = seen[n:] = True
        for layer, probs in enumerate(out.attentions):
            rows = probs[0, :, n:].detach().double() * seen
            rows = rows / rows.sum(-1, keepdim=True)  # [H_q, m, n + m] over KVzip's keys only
            grad_norm = grads[layer][0, n:].double().norm(dim=-1)  # [m]
            w_o = eager.model.layers[layer].self_attn.o_proj.weight.double()
            values = cache.layers[layer].values[0].detach().double()  # [H_kv, n + m, D]
            for kv in range(h_kv):
                best = torch.zeros(end - start, dtype=torch.double)
                for h in range(kv * g, (kv + 1) * g):
                    v_norm = (values[kv, start:end] @ w_o[:, h * d:(h + 1) * d].T).norm(dim=-1)
                    s = rows[h, :, start:end] * v_norm[None] * grad_norm[:, None]
                    best = torch.maximum(best, s.amax(0))
                scores[layer, kv, start:end] = best.float()
    scores[..., :SINK] = float("inf")
    return scores


def test_keeps_the_recomputed_global_top_entries_and_leaves_no_gradient():
    model, ids = peaked_model(), prompt(N)
    method = METHODS["kvgrad"](chunk_size=CHUNK, prompt_ids=PROMPT_IDS)
    assert [(s, e) for s, e, _ in method.reconstruction_inputs(ids)] == [(4, 52), (52, 100)]
    with AttentionCapture(model) as capture:
        gen = prepare(model, method, capture, ids, BUDGET, 1)
    kept = [kept_positions(layer) for layer in gen.cache.layers]
    assert all(p.grad is None and p.requires_grad for p in model.parameters())  # weights untouched
    assert not any(t.requires_grad for layer in gen.cache.layers for t in (layer.flat_keys, layer.flat_values))
    scores = reference_scores(model, method, ids)
    cut = scores.flatten().topk(BUDGET * scores.shape[0] * scores.shape[1]).values[-1]
    eps = 1e-4 * float(cut)
    assert sum(len(h) for heads in kept for h in heads) == BUDGET * scores.shape[0] * scores.shape[1]
    for layer, heads in enumerate(kept):
        for head, positions in enumerate(heads):
            mask = torch.zeros(N, dtype=torch.bool)
            mask[positions] = True
            s = scores[layer, head]
            assert bool(mask[s > cut + eps].all()) and not bool(mask[s < cut - eps].any()), (layer, head)
    assert gen.kv_bytes < gen.full_kv_bytes


def test_prompts_are_kvpress_texts(smollm2_tokenizer):
    method = METHODS["kvgrad"]()
    method.prepare(None, smollm2_tokenizer)
    assert method.chunk_size == 512
    assert smollm2_tokenizer.decode(method.prompt_ids[1]) == \
        "\n\nRepeat the part of the previous context exactly, starting with"
