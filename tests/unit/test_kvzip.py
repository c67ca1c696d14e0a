"""KVzip (kvbench/methods/kvzip.py) against an independent recomputation.

The reference here builds each reconstruction input by hand, runs the plain transformers model eagerly with
`output_attentions=True` over context + input in ONE forward (the input then sits right after the context, as
KVzip places it), renormalizes each row's probabilities over the keys KVzip's softmax sees (sinks + chunk + the input
itself), takes the max over each KV group's query heads and the input's rows, and picks one top-k over all layers and
heads. kvbench must keep exactly those entries (up to float near-ties at the cut) and really free the rest."""
from __future__ import annotations

import pytest
import torch

import kvbench.methods  # noqa: F401
from kvbench.engine.batching import generate
from kvbench.engine.generation import prepare
from kvbench.models import AttentionCapture
from kvbench.models.embedded import embedded_model_dir
from kvbench.registry import METHODS
from tests.unit.tiny import prompt, tiny_model

PROMPT_IDS = [[5, 6, 7], [8, 9, 10, 11], [12]]  # first prompt, next prompt, suffix (a tiny model's vocabulary)
N, BUDGET, CHUNK, SINK, POSTFIX = 150, 40, 64, 4, 8


def peaked_model(layers: int = 2):
    """Two layers of GQA (6 query heads, 2 KV heads) with queries scaled up, so attention is far from uniform."""
    model = tiny_model("llama", layers=layers)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(30)
    return model


def kept_positions(layer) -> list[list[int]]:
    heads = layer.flat_positions.split(layer.head_lens.tolist())
    return [sorted(h.tolist()) for h in heads]


def test_reconstruction_inputs_by_hand():
    """n = 12, 2 sinks, chunks of 4, 2 quoted tokens: the chunks repeat [2, 6), [6, 10), [10, 12)."""
    method = METHODS["kvzip"](chunk_size=4, prev_postfix_size=2, n_sink=2, prompt_ids=PROMPT_IDS)
    ctx = torch.arange(100, 112)[None]
    got = [(s, e, ids[0].tolist()) for s, e, ids in method.reconstruction_inputs(ctx)]
    assert got == [(2, 6, [5, 6, 7, 12, 102, 103, 104, 105]),
                   (6, 10, [8, 9, 10, 11, 104, 105, 12, 106, 107, 108, 109]),
                   (10, 12, [8, 9, 10, 11, 108, 109, 12, 110, 111])]


def test_prompts_are_the_references_texts_and_the_chat_suffix():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(embedded_model_dir()))
    plain, chat = METHODS["kvzip"](), METHODS["kvzip"](chat_template=True)
    plain.prepare(None, tokenizer)
    chat.prepare(None, tokenizer)
    texts = [tokenizer.decode(ids) for ids in plain.prompt_ids]
    assert texts == ["\n\nRepeat the previous context exactly.",
                     "\n\nRepeat the part of the previous context exactly, starting with ", "\n"]
    assert tokenizer.decode(chat.prompt_ids[2]) == "<|im_end|>\n<|im_start|>assistant\n"  # SmolLM2's template
    assert chat.prompt_ids[:2] == plain.prompt_ids[:2]


def test_reconstruction_runs_after_the_context_and_is_dropped():
    """Each chunk's input is prefilled at positions n, n+1, ... on top of the n-entry cache, then removed."""
    model, ids = tiny_model("llama", layers=2), prompt(N)
    method = METHODS["kvzip"](chunk_size=CHUNK, prompt_ids=PROMPT_IDS)
    calls = []

    def record(module, args, kwargs):
        cache = kwargs["past_key_values"]
        calls.append((kwargs["position_ids"][0].tolist(), cache.layers[0].keys.shape[-2] if cache.layers else 0,
                      kwargs["input_ids"][0].tolist()))

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with AttentionCapture(model) as capture:
            generate(model, None, method, capture, ids, BUDGET, 1, eos_ids=set())
    finally:
        handle.remove()
    inputs = method.reconstruction_inputs(ids)
    assert [(s, e) for s, e, _ in inputs] == [(4, 68), (68, 132), (132, 150)]
    assert calls[0] == (list(range(N)), 0, ids[0].tolist())  # the prefill
    for (_, _, x), (positions, held, fed) in zip(inputs, calls[1:]):
        assert fed == x[0].tolist() and held == N and positions == list(range(N, N + x.shape[1]))
    assert len(calls) == 1 + len(inputs)  # then nothing else before decoding (max_new_tokens=1)


def reference_kept(model, ids: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores `[L, H_kv, n]` (sinks at +inf) by eager attention over context + each input, and the top-k mask."""
    n, n_heads, n_kv = ids.shape[1], model.config.num_attention_heads, model.config.num_key_value_heads
    scores = torch.zeros(model.config.num_hidden_layers, n_kv, n)
    first, following, suffix = (torch.tensor(x) for x in PROMPT_IDS)
    for start in range(SINK, n, CHUNK):
        end = min(start + CHUNK, n)
        quoted = torch.tensor([]) if start == SINK else torch.cat([following, ids[0, start - POSTFIX:start]])
        repeat = torch.cat([first if start == SINK else quoted, suffix, ids[0, start:end]]).long()
        m = repeat.shape[0]
        with torch.no_grad():
            out = model(torch.cat([ids[0], repeat])[None], output_attentions=True)
        seen = torch.zeros(n + m, dtype=torch.bool)  # the keys KVzip's softmax sees
        seen[:SINK] = seen[start:end] = seen[n:] = True
        for layer, probs in enumerate(out.attentions):
            rows = probs[0, :, n:].double()  # [H_q, m, n + m] over every key
            rows = rows * seen / (rows * seen).sum(-1, keepdim=True)  # softmax over the seen keys only
            per_kv = rows[..., start:end].amax(dim=1).view(n_kv, n_heads // n_kv, -1).amax(dim=1)
            scores[layer, :, start:end] = per_kv.float()
    scores[..., :SINK] = float("inf")
    k = budget * scores.shape[0] * n_kv
    return scores, scores.flatten().topk(k).values[-1]


def test_keeps_the_recomputed_global_top_entries():
    model, ids = peaked_model(), prompt(N)
    method = METHODS["kvzip"](chunk_size=CHUNK, prompt_ids=PROMPT_IDS)
    with AttentionCapture(model) as capture:
        gen = prepare(model, method, capture, ids, BUDGET, 1)
        kept = [kept_positions(layer) for layer in gen.cache.layers]
    eager = tiny_model("llama", layers=2, attn="eager")
    eager.load_state_dict(model.state_dict())
    scores, cut = reference_kept(eager, ids, BUDGET)
    eps = 1e-5 * float(cut)
    n_layers, n_kv = scores.shape[:2]
    assert sum(len(h) for heads in kept for h in heads) == BUDGET * n_layers * n_kv
    lengths = {len(h) for heads in kept for h in heads}
    assert len(lengths) > 1  # heads really keep different lengths
    for layer in range(n_layers):
        for head in range(n_kv):
            mask = torch.zeros(N, dtype=torch.bool)
            mask[kept[layer][head]] = True
            s = scores[layer, head]
            assert bool(mask[s > cut + eps].all()), (layer, head)  # everything clearly above the cut is kept
            assert not bool(mask[s < cut - eps].any()), (layer, head)  # nothing clearly below it
            assert mask[:SINK].all()
    # the memory really shrank: 2 (K, V) x kept entries x head dim x 4 bytes, first token's entry included
    d = model.config.hidden_size // model.config.num_attention_heads
    assert gen.kv_bytes == 2 * BUDGET * n_layers * n_kv * d * 4 < gen.full_kv_bytes


def test_no_compression_when_the_context_fits_and_bad_knobs():
    model, ids = tiny_model("llama", layers=2), prompt(30)
    method = METHODS["kvzip"](prompt_ids=PROMPT_IDS)
    with AttentionCapture(model) as capture:
        gen = generate(model, None, method, capture, ids, 32, 1, eos_ids=set())
    assert gen.kv_bytes == gen.full_kv_bytes
    with pytest.raises(ValueError, match="n_sink"):
        method.check_budget(4)
    with pytest.raises(ValueError, match="chunk_size"):
        METHODS["kvzip"](chunk_size=0)
    with pytest.raises(ValueError, match="prepare"):
        METHODS["kvzip"]().reconstruction_inputs(ids)


@pytest.mark.parametrize("dataset,query,args", [
    ("niah", "aware", ["dataset.context_lengths=[300]", "dataset.depth_percents=[50]"]),
    ("niah_multiturn", "agnostic", ["dataset.turns=2", "dataset.turn_mode=append"]),
    ("scbench", "aware", ["dataset.tasks=[scbench_kv]", "dataset.limit_per_task=1", "dataset.max_turns=2",
                          "dataset.max_new_tokens=3"]),
], ids=["niah", "niah_multiturn-agnostic", "scbench"])
def test_runs_through_the_command_path(tmp_path, dataset, query, args):
    """The whole run path (the tokenizer's prompts, `query=agnostic`, turns; every dataset was run by hand, on the
    tiny and the embedded model, both modes): a question-agnostic run compresses the context to a mean of exactly
    `budget` per head, then keeps the question's tokens on top."""
    from tests.unit.test_cli import records, run_here
    from tests.unit.test_method_datasets import FIXTURES

    root = [f"dataset.root={FIXTURES / 'scbench'}"] if dataset == "scbench" else []
    run_dir = run_here("model=tiny_llama", "method=kvzip", "budget=32", f"dataset={dataset}", "limit=1",
                       "report=false", f"query={query}", *root, *args, results=tmp_path)
    recs = records(run_dir)
    assert recs and all("error" not in r for r in recs)
    first = recs[0]
    mean = sum(first["kept_per_layer"]) / len(first["kept_per_layer"])
    assert mean == pytest.approx(32 + first.get("question_tokens", 0))
    assert ("question_tokens" in first) == (query == "agnostic")
    assert first["kv_bytes"] < first["full_kv_bytes"]
