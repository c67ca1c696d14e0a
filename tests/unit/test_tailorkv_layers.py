"""TailorKV layer identification: the sparse-error score on hand-made attention, `identify` against independent
recomputations on a tiny random model, the calibration prompt and its stand-in, and the command line."""
from __future__ import annotations

import json
import re

import pytest
import torch

from kvbench.engine.generation import prefill
from kvbench.methods.tailorkv_calibration import stand_in_pairs
from kvbench.methods.tailorkv_layers import (
    FINAL_QUESTION,
    calibration_prompt,
    identify,
    load_gsm8k_pairs,
    quant_layers,
    sparse_error,
)
from tests.unit.tiny import prompt, tiny_model


def random_queries(h_q: int = 4, w: int = 32, d: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, h_q, w, d, generator=torch.Generator().manual_seed(seed))


# --- the score on hand-made attention -----------------------------------------------------------------------------
@pytest.mark.parametrize("n", [200, 210])
def test_uniform_attention_scores_one_minus_the_topk_share(n):
    keys = torch.zeros(1, 2, n, 8)  # every logit 0: each row is uniform 1/n
    score = sparse_error(random_queries(), keys, scaling=8 ** -0.5)
    assert score == pytest.approx(1 - int(0.05 * n) / n, abs=1e-6)  # 0.95 at n=200; k=10 also at n=210
    assert quant_layers([score]) == [0]


def test_one_hot_attention_scores_zero():
    keys = torch.zeros(1, 2, 200, 8)
    keys[:, :, 7] = 50.0
    queries = torch.ones(1, 4, 32, 8)  # logit 50*8/sqrt(8) ~ 141 on key 7, 0 elsewhere
    score = sparse_error(queries, keys, scaling=8 ** -0.5)
    assert score == pytest.approx(0.0, abs=1e-6)
    assert quant_layers([score]) == []


def test_score_is_the_mean_over_query_heads_and_present_queries():
    keys = torch.zeros(1, 2, 200, 8)
    keys[:, 1, 7] = 50.0  # KV head 0 uniform (0.95), KV head 1 one-hot (0): query heads 0-1 vs 2-3
    for w in (32, 5):  # fewer queries than last_q: divided by the w present
        queries = torch.ones(1, 4, w, 8)
        assert sparse_error(queries, keys, scaling=8 ** -0.5) == pytest.approx(0.475, abs=1e-6)


def test_causal_mask_hides_later_keys():
    n, w = 200, 32
    keys = torch.zeros(1, 2, n, 8)
    # query i sits at position n - w + i and sees n - w + i + 1 keys, uniformly; k = int(0.05 * n) still
    expected = sum(1 - 10 / (n - w + i + 1) for i in range(w)) / w
    assert sparse_error(random_queries(w=w), keys, 8 ** -0.5, causal=True) == pytest.approx(expected, abs=1e-6)
    assert sparse_error(random_queries(w=w), keys, 8 ** -0.5) == pytest.approx(0.95, abs=1e-6)


def test_threshold_is_strict():
    assert quant_layers([0.95, 0.2, 0.2000001, 0.01], tau=0.2) == [0, 2]
    assert quant_layers([0.5, 0.3], tau=0.4) == [0]


def test_half_precision_matches_fp32():
    queries, keys = random_queries(seed=1), torch.randn(1, 2, 300, 8, generator=torch.Generator().manual_seed(2))
    full = sparse_error(queries, keys, 8 ** -0.5)
    half = sparse_error(queries.half(), keys.half(), 8 ** -0.5)
    assert half == pytest.approx(full, abs=2e-3)


# --- identify on a tiny model, against independent paths ----------------------------------------------------------
def reference_scores(probs_last: list[torch.Tensor], alpha: float = 0.05) -> list[float]:
    """Scores from `[1, H_q, w, n]` probability blocks, written out once more for the test."""
    out = []
    for p in probs_last:
        k = int(alpha * p.shape[-1])
        out.append(((p.sum() - p.topk(k, dim=-1).values.sum()) / (p.shape[1] * p.shape[2])).item())
    return out


def test_identify_causal_equals_hf_eager_attention_weights():
    ids = prompt(100)
    result = identify(tiny_model("llama", layers=3), ids, causal=True, prefill=prefill)
    eager = tiny_model("llama", layers=3, attn="eager")
    with torch.no_grad():
        attentions = eager(ids, output_attentions=True).attentions  # causal probabilities [1, H_q, n, n]
    expected = reference_scores([a[:, :, -32:] for a in attentions])
    assert result.scores == pytest.approx(expected, abs=1e-5)
    assert result.prompt_len == 100 and result.quant_layers == quant_layers(expected, 0.2)


def test_identify_default_equals_a_manual_unmasked_recomputation():
    model = tiny_model("llama", layers=3)
    ids = prompt(100)
    hidden = {}
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda mod, args, kwargs, i=i: hidden.__setitem__(i, kwargs.get("hidden_states", args[0] if args else None)),
        with_kwargs=True) for i, layer in enumerate(model.model.layers)]
    result = identify(model, ids, prefill=prefill)
    for h in hooks:
        h.remove()

    cfg = model.config
    d, h_q, h_kv, n = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, ids.shape[1]
    inv_freq = 1.0 / cfg.rope_parameters["rope_theta"] ** (torch.arange(0, d, 2).float() / d)
    angles = torch.arange(n).float()[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

    def rope(x):  # [1, H, n, d], rotate-half convention
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    blocks = []
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            q = rope(attn.q_proj(hidden[i]).view(1, n, h_q, d).transpose(1, 2))
            k = rope(attn.k_proj(hidden[i]).view(1, n, h_kv, d).transpose(1, 2))
            k = k.repeat_interleave(h_q // h_kv, dim=1)
            blocks.append(torch.softmax(q[:, :, -32:] @ k.transpose(-1, -2) / d ** 0.5, dim=-1))  # no mask
    assert result.scores == pytest.approx(reference_scores(blocks), abs=1e-5)
    assert result.scores != pytest.approx(identify(model, ids, causal=True, prefill=prefill).scores, abs=1e-3)


def test_identify_on_a_prompt_shorter_than_last_q():
    result = identify(tiny_model("qwen2", layers=2), prompt(12), alpha=0.25, prefill=prefill)
    assert len(result.scores) == 2 and all(0.0 <= s <= 1.0 for s in result.scores)


# --- calibration prompt -------------------------------------------------------------------------------------------
def test_calibration_prompt_format():
    pairs = [("What is 1+1?", "1+1 = <<1+1=2>>2\n#### 2"), ("Is it?", "Yes.\n#### 1")]
    assert calibration_prompt(pairs) == (
        "Question: What is 1+1?\nAnswer: 1+1 = <<1+1=2>>2\n#### 2\n"
        "Question: Is it?\nAnswer: Yes.\n#### 1\n"
        "Question: John takes care of 10 dogs. Each dog takes .5 hours a day to walk and take care of their "
        "business. How many hours a week does he spend taking care of dogs?")
    assert FINAL_QUESTION.endswith("taking care of dogs?")


def test_stand_in_has_50_pairs_with_correct_arithmetic():
    pairs = stand_in_pairs()
    assert len(pairs) == 50 and len(set(pairs)) == 50 and pairs == stand_in_pairs()
    for question, answer in pairs:
        steps = re.findall(r"<<([0-9+\-*/ ]+)=(\d+)>>(\d+)", answer)
        assert steps and answer.count("<<") == len(steps), answer
        for expr, value, shown in steps:
            assert eval(expr) == int(value) == int(shown), answer
        assert answer.splitlines()[-1] == f"#### {steps[-1][1]}"
        assert question.endswith("?") and "\n" not in question


def test_load_gsm8k_pairs_takes_the_first_50(tmp_path):
    rows = [{"question": f"q{i}?", "answer": f"a\n#### {i}"} for i in range(60)]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs = load_gsm8k_pairs(path)
    assert len(pairs) == 50 and pairs[0] == ("q0?", "a\n#### 0") and pairs[-1][0] == "q49?"
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    pd.DataFrame(rows).to_parquet(tmp_path / "train.parquet")
    assert load_gsm8k_pairs(tmp_path / "train.parquet") == pairs
    (tmp_path / "short.jsonl").write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(ValueError, match="question"):
        load_gsm8k_pairs(tmp_path / "short.jsonl")


# --- command line -------------------------------------------------------------------------------------------------
def test_cli_on_a_random_model(capsys):
    """`python -m kvbench.methods.tailorkv_layers --model random:llama` as its main runs it, in this process."""
    from kvbench.methods.tailorkv_layers.__main__ import main

    main(["--model", "random:llama", "--device", "cpu"])
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"quant_layers: \[[0-9, ]*\]  prompt_tokens: \d+", lines[-1])
    assert sum(bool(re.match(r"\d+\s+\d\.\d{4}\s+(quantization|sparsity)-friendly$", ln)) for ln in lines) == 2
