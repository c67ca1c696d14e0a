"""The ceiling of the load benchmark (kvbench.serving.ceiling): transformers' own `generate` at batch M and batch N
must do the same work per prompt as at batch 1, or the speed-up it gives is not the one batching allows. On a tiny
random Llama: each prompt's greedy tokens at batch 3 and 2 are its tokens alone (up to a near-tied step, where
either token is a right argmax), batch 1's are an eager recomputation's (full forward over the growing sequence,
no cache), every call decodes exactly `new_tokens`, and the ratios are the calls' own tokens/s over each other."""
from __future__ import annotations

import pytest
import torch

from kvbench.models.tiny import tiny_random_model
from kvbench.serving.ceiling import Ceiling, hf_batch, same_greedy_tokens

torch.set_num_threads(1)
NEW = 8


@pytest.fixture(scope="module")
def model():
    m = tiny_random_model("llama", vocab_size=256)
    m.generation_config.eos_token_id = 3  # a token the random model picks now and then: held off until NEW
    return m


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(4, 256, (n,), generator=g).tolist() for n in (40, 37, 45)]


def eager_greedy(model, ids: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy by hand: the whole sequence through the model at each step, EOS masked (as min_new_tokens does)."""
    tokens, margins = [], []
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(torch.tensor([ids + tokens])).logits[0, -1].clone()
            logits[model.generation_config.eos_token_id] = float("-inf")
            top = logits.topk(2).values
            margins.append(float(top[0] - top[1]))
            tokens.append(int(logits.argmax()))
    return tokens, margins


def agree_until_a_tie(mine: list[int], theirs: list[int], margins: list[float], tie: float = 1e-4) -> bool:
    for t, (a, b) in enumerate(zip(mine, theirs)):
        if margins[t] < tie:
            return True
        if a != b:
            return False
    return True


def test_batches_do_each_prompts_batch_one_work(model, prompts):
    length = min(map(len, prompts))
    together = {b: hf_batch(model, prompts, b, NEW) for b in (2, 3)}
    for b, call in together.items():
        assert call.batch == b and call.prompt_len == length and call.new_tokens == NEW
        assert [len(t) for t in call.tokens] == [NEW] * b  # EOS held off: the same number of tokens at every size
    for row in range(3):
        alone = hf_batch(model, [prompts[row][:length]], 1, NEW)
        want, margins = eager_greedy(model, prompts[row][:length], NEW)
        assert agree_until_a_tie(alone.tokens[0], want, margins)
        for b, call in together.items():
            if row < b:
                assert same_greedy_tokens(alone, call, row)


def test_a_different_token_is_caught(model, prompts):
    """The fairness check can fail: a row whose tokens differ from batch 1's before any near-tie."""
    alone = hf_batch(model, prompts, 1, NEW)
    other = hf_batch(model, prompts[1:], 1, NEW)
    assert alone.margins[0][0] >= 1e-4 and alone.tokens[0][0] != other.tokens[0][0]  # (so on this model and seed)
    assert not same_greedy_tokens(alone, other, 0)
    assert same_greedy_tokens(alone, alone, 0)


def test_the_ratios_are_the_calls_tokens_per_second(model, prompts):
    m, n = hf_batch(model, prompts, 3, NEW), hf_batch(model, prompts, 1, NEW)
    c = Ceiling(m, n)
    assert c.ratio == pytest.approx((3 * NEW / m.seconds) / (NEW / n.seconds))
    assert c.decode_ratio == pytest.approx((3 * (NEW - 1) / (m.seconds - m.prefill_s))
                                           / ((NEW - 1) / (n.seconds - n.prefill_s)))
    with pytest.raises(ValueError, match="batch 4 needs 1..3 prompts"):
        hf_batch(model, prompts, 4, NEW)
