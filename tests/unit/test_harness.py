"""kvbench as an lm-eval model (kvbench.harness, lm-eval==0.4.13) on the tiny random Llama with the embedded
tokenizer: loglikelihood under the full cache equals one direct forward and lm-eval's own `hf` model; a compressed
context changes it; bad arguments are one line. lm-eval's command line on a local task, end to end into the report
(its acc from our loglikelihoods, the imported records): Keyformer Table 2's smoke form in
tests/integration/test_paper_smoke.py (keyformer_table_2); the import by hand: test_paper_keyformer_buzz.py."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("lm_eval")

from kvbench.runs.harness import KVBenchLM, split_model_args  # noqa: E402

CONTEXT = ("The keeper of the kvbench lighthouse painted its door blue in 1931, and the harbour board paid for "
           "the paint, the brushes and the ladder. The door was")


@pytest.fixture(scope="module")
def full():
    return KVBenchLM(model="tiny_llama", method="full")


def direct(lm, context, continuation) -> tuple[float, bool]:
    with torch.no_grad():
        logits = lm.model(torch.tensor([context + continuation])).logits[0].float().log_softmax(-1)
    rows = logits[len(context) - 1: len(context) + len(continuation) - 1]
    picked = rows[torch.arange(len(continuation)), torch.tensor(continuation)]
    return picked.sum().item(), bool((rows.argmax(-1) == torch.tensor(continuation)).all())


def test_full_cache_loglikelihood_is_one_forward(full):
    ctx, cont = full._encode_pair(CONTEXT, " blue and white")
    (got,) = full._loglikelihood_tokens([((CONTEXT, " blue and white"), ctx, cont)], disable_tqdm=True)
    want = direct(full, ctx, cont)
    assert got[0] == pytest.approx(want[0], rel=1e-5) and got[1] == want[1] and len(cont) >= 2


def test_compressed_context_changes_the_score(full):
    h2o = KVBenchLM(model="tiny_llama", method="h2o", budget=8, **{"method.recent_ratio": 0.25})
    assert h2o.method.recent_ratio == 0.25
    ctx, cont = full._encode_pair(CONTEXT, " blue and white, said the keeper")
    (a,), (b,) = (lm._loglikelihood_tokens([(("", ""), ctx, cont)], disable_tqdm=True) for lm in (full, h2o))
    roomy = KVBenchLM(model="tiny_llama", method="h2o", budget=1000)  # nothing to evict: exactly the full cache
    (c,) = roomy._loglikelihood_tokens([(("", ""), ctx, cont)], disable_tqdm=True)
    assert c == a and abs(a[0] - b[0]) > 1e-5  # tokens after the first read the compressed cache
    (one_full,), (one_h2o,) = (lm._loglikelihood_tokens([(("", ""), ctx, cont[:1])], disable_tqdm=True)
                               for lm in (full, h2o))
    assert one_full == one_h2o  # the first continuation token is scored from the prefill (full attention)


def test_bad_arguments_are_one_line():
    with pytest.raises(ValueError, match="kvbench: Unknown method 'h2'. Did you mean: h2o"):
        KVBenchLM(model="tiny_llama", method="h2", budget=8)
    with pytest.raises(ValueError, match="exactly one of budget"):
        KVBenchLM(model="tiny_llama", method="h2o")


def test_full_cache_equals_lm_evals_own_hf_model_on_loglikelihood_requests(full):
    """The same requests through lm-eval's `hf` model (HFLM over the same weights and tokenizer) and through
    kvbench's teacher-forced streams: equal log-likelihoods and greedy flags."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    pairs = [(CONTEXT, " blue and white"), (CONTEXT, " red"), ("The harbour board paid for", " the paint, the ladder")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    hf = HFLM(pretrained=full.model, tokenizer=full.tokenizer, batch_size=1, device="cpu")
    want, got = hf.loglikelihood(requests, disable_tqdm=True), full.loglikelihood(requests, disable_tqdm=True)
    assert len(got) == len(want) == 3
    for (lp, greedy), (lp_hf, greedy_hf) in zip(got, want):
        assert lp == pytest.approx(lp_hf, rel=1e-5, abs=1e-5) and greedy == greedy_hf


def test_each_model_args_is_one_run_of_one_command():
    """`python -m kvbench.harness ... --model_args A --model_args=B`: one lm-eval run per value (lm-eval alone
    keeps the last)."""
    runs, rest = split_model_args(["--model", "kvbench", "--model_args", "method=full", "--tasks", "copa",
                                   "--model_args=method=h2o,ratio=0.5", "--log_samples"])
    assert runs == ["method=full", "method=h2o,ratio=0.5"]
    assert rest == ["--model", "kvbench", "--tasks", "copa", "--log_samples"]
