"""KVCompose (kvbench/methods/kvcompose.py) against an independent recomputation and kvpress's kept sets.

The reference feeds context + context in ONE eager forward of the plain transformers model (`output_attentions`), so
the second copy's rows attend the first copy and themselves as the replay does, and rebuilds kvpress's arithmetic
with plain loops over layers and heads: max over rows, mean over each group, + the layer's mean, sorted curves,
their mean per layer, layer 0 the max of all, one top-k for the per-layer counts (or per-head counts). kvbench must
keep those counts and each head's top entries (ties either way), and really hold only them. Against kvpress's own
kept sets: tests/unit/test_kvpress_scorers3.py."""
from __future__ import annotations

import pytest
import torch

import kvbench.methods  # noqa: F401
from kvbench.engine.generation import prepare
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from tests.unit.test_kvzip import peaked_model
from tests.unit.test_presses import assert_top
from tests.unit.tiny import prompt, tiny_model

N, BUDGET = 60, 20


def reference(model, ids, budget, structured=True):
    """(scores [L][H] lists, counts per layer or per (layer, head)) by kvpress's rule, from eager attention."""
    eager = tiny_model("llama", layers=model.config.num_hidden_layers, attn="eager")
    eager.load_state_dict(model.state_dict())
    n, g = ids.shape[1], model.config.num_attention_heads // model.config.num_key_value_heads
    with torch.no_grad():
        out = eager(torch.cat([ids, ids], dim=1), output_attentions=True)
    scores = []
    for probs in out.attentions:
        per_q = [probs[0, h, n:, :n].amax(dim=0) for h in range(probs.shape[1])]  # max over the replay's rows
        per_kv = [sum(per_q[k * g:(k + 1) * g]) / g for k in range(len(per_q) // g)]
        mean = sum(per_kv) / len(per_kv)
        scores.append([s + mean for s in per_kv])
    curves = [[s.sort(descending=True).values for s in layer] for layer in scores]
    if structured:
        layer_curves = torch.stack([sum(c) / len(c) for c in curves])
        layer_curves[0] = layer_curves.max(dim=0).values
        top = layer_curves.flatten().topk(budget * len(scores)).indices // n
        return scores, [max(1, int((top == i).sum())) for i in range(len(scores))]
    flat = torch.stack([torch.stack(c) for c in curves]).flatten()
    top = flat.topk(budget * len(scores) * len(scores[0])).indices // n
    return scores, [[int((top == i * len(c) + h).sum()) for h in range(len(c))] for i, c in enumerate(curves)]


def kept_positions(layer) -> list[list[int]]:
    if hasattr(layer, "flat_positions"):
        return [sorted(h.tolist()) for h in layer.flat_positions.split(layer.head_lens.tolist())]
    return [sorted(h.tolist()) for h in layer.positions[0]]


@pytest.mark.parametrize("structured", [True, False])
def test_keeps_the_recomputed_counts_and_each_heads_top_entries(structured):
    model, ids = peaked_model(layers=3), prompt(N)
    with AttentionCapture(model) as capture:
        gen = prepare(model, METHODS["kvcompose"](structured=structured), capture, ids, BUDGET, 1)
    kept = [kept_positions(layer) for layer in gen.cache.layers]
    scores, counts = reference(model, ids, BUDGET, structured)
    for i, heads in enumerate(kept):
        assert [len(h) for h in heads] == ([counts[i]] * len(heads) if structured else counts[i])
        for h, positions in enumerate(heads):
            if positions:
                assert_top(torch.tensor([positions]), scores[i][h][None], len(positions))
    sizes = {len(h) for heads in kept for h in heads}
    assert len(sizes) > 1  # layers (structured) or heads really keep different lengths
    assert sum(len(h) for heads in kept for h in heads) >= BUDGET * len(kept) * len(kept[0])
    assert gen.kv_bytes < gen.full_kv_bytes
    if structured:
        assert not any(hasattr(layer, "flat_positions") for layer in gen.cache.layers)  # dense layers


def test_bad_knobs_fail_in_one_line():
    with pytest.raises(ValueError, match="agg_task='sum' is not one of max, mean"):
        METHODS["kvcompose"](agg_task="sum")
    with pytest.raises(ValueError, match="keep_token_lower_bound"):
        METHODS["kvcompose"](keep_token_lower_bound=-1)
