"""kvbench as an lm-eval model (kvbench.harness, lm-eval==0.4.13) on the tiny random Llama with the embedded
tokenizer: loglikelihood under the full cache equals one direct forward; a compressed context changes it; and
lm-eval's own command line runs a local multiple-choice task end to end (no download)."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("lm_eval")

from kvbench.report import load_runs  # noqa: E402
from kvbench.report.lm_eval_runs import main as import_main  # noqa: E402
from kvbench.runs.harness import KVBenchLM, main  # noqa: E402

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


def test_lm_eval_command_line_runs_a_local_task(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rows = [{"question": "The lighthouse door was painted", "choices": [" blue", " green", " red"], "answer": 0},
            {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0}]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "kvbench_mc.yaml").write_text(
        "task: kvbench_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tmp_path / 'data.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n")
    main(["--model", "kvbench", "--model_args", "model=tiny_llama,method=h2o,budget=8", "--tasks", "kvbench_mc",
          "--include_path", str(tmp_path), "--output_path", str(tmp_path / "out"), "--log_samples"])
    (results,) = (tmp_path / "out").rglob("results_*.json")
    (samples,) = (tmp_path / "out").rglob("samples_kvbench_mc_*.jsonl")
    logged = [json.loads(line) for line in samples.read_text().splitlines()]
    acc = json.loads(results.read_text())["results"]["kvbench_mc"]["acc,none"]
    # lm-eval's acc from our loglikelihoods: the argmax choice is the target
    expected = sum(max(range(len(s["filtered_resps"])), key=lambda i: float(s["filtered_resps"][i][0])) == 0
                   for s in logged) / len(logged)
    assert len(logged) == 2 and acc == expected
    # imported as a kvbench run (Keyformer Table 2's path into the report): its records average to lm-eval's acc
    import_main([str(tmp_path / "out"), "--out", str(tmp_path / "runs")])
    df = load_runs([tmp_path / "runs"])
    assert df["scores.acc"].mean() == acc and set(df["meta.task"]) == {"kvbench_mc"}
    assert set(df["meta.num_fewshot"]) == {0}
    assert (df["method"].iloc[0], df["budget"].iloc[0], df["model"].iloc[0]) == ("h2o", 8, "tiny-llama")


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
