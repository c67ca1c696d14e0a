"""The reasoning sets (gsm8k, math500, aime24, aime25): repeated samples and pass@1 with its se over problems, the
chat template's thinking switch, the download script's files, one-line refusals, and each set end to end on its
fixture on the tiny random model."""
from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from kvbench.data.gsm8k import Gsm8k
from kvbench.data.reasoning import Aime24, Aime25, Math500, pass_at_1
from kvbench.runs.run import prompt_split
from tests.unit.test_cli import records, refusal, run_here

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
ROOT = Path(__file__).resolve().parents[2]
# a Qwen3-like switch: the assistant turn opens with an empty think block when thinking is off
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def test_samples_repeat_each_problem_in_a_row_with_their_own_ids():
    samples = Aime25(root=str(FIXTURES / "aime25"), samples=3).build(None)
    assert [s.id for s in samples[:4]] == ["aime25-000#0", "aime25-000#1", "aime25-000#2", "aime25-001#0"]
    assert len(samples) == 9 and len({s.id for s in samples}) == 9
    assert {s.prompt for s in samples[:3]} == {samples[0].prompt} and samples[0].meta["problem"] == "aime25-000"
    assert [s.meta["sample"] for s in samples[:3]] == [0, 1, 2] and samples[0].answers == ["91"]
    one = Aime24(root=str(FIXTURES / "aime24")).build(None)
    assert [s.id for s in one] == ["aime24-000", "aime24-001", "aime24-002"]  # samples=1: plain ids
    assert one[0].answers == ["023"] and one[0].meta["source_id"] == 1 and one[0].max_new_tokens == 32768
    assert one[0].prompt.startswith("You are given a math problem.\n\nProblem: Find the number")
    assert one[0].prompt.endswith("\n\n Provide the final answer in the format: Final answer:  \\boxed{}")
    math = Math500(root=str(FIXTURES / "math500"), prompt="kvpress").build(None)
    assert math[0].prompt == json.loads((FIXTURES / "math500" / "test.jsonl").read_text().splitlines()[0])["problem"]
    assert math[0].meta["source_id"] == "test/prealgebra/lookalike-1.json" and math[0].context_end is None


def test_pass_at_1_averages_problem_means_and_its_se_is_over_problems():
    per_problem = {"a": [1, 1, 0, 0], "b": [1, 1, 1, 1], "c": [0, 0, 0, 0]}
    recs = [{"meta": {"problem": p}, "scores": {"math_verify": float(v), "answered": 1.0}, "new_tokens": 10 + i}
            for p, values in per_problem.items() for i, v in enumerate(values)]
    out = pass_at_1(recs, ("math_verify",))["math_verify"]
    means = [0.5, 1.0, 0.0]
    assert out["mean"] == pytest.approx(0.5) and out["n_problems"] == 3 and out["samples_per_problem"] == [4, 4]
    assert out["se"] == pytest.approx(np.std(means, ddof=1) / math.sqrt(3))  # not sd of 12 samples / sqrt(12)
    summary = Aime25(root=str(FIXTURES / "aime25"), samples=4, max_new_tokens=13).summarize(recs)["reasoning"]
    assert summary["pass@1"]["answered"]["mean"] == 1.0 and summary["pass@1"]["answered"]["se"] == 0.0
    assert summary["new_tokens_max"] == 13 and summary["cut_at_max_new_tokens"] == pytest.approx(3 / 12)


def test_thinking_switch_reaches_the_chat_template(smollm2_tokenizer, caplog):
    spec = SimpleNamespace(chat_template=True, max_prompt_tokens=8000)
    before = smollm2_tokenizer.chat_template
    try:
        smollm2_tokenizer.chat_template = THINKING_TEMPLATE
        rendered = {}
        for thinking in (None, True, False):
            sample = Aime25(root=str(FIXTURES / "aime25"), thinking=thinking).build(smollm2_tokenizer, 8000, True)[0]
            assert sample.chat_template_kwargs == ({} if thinking is None else {"enable_thinking": thinking})
            ids, _ = prompt_split(sample, smollm2_tokenizer, spec, split=False)
            rendered[thinking] = smollm2_tokenizer.decode(ids)
        assert rendered[None] == rendered[True] and rendered[False] == rendered[True] + "<think>\n\n</think>\n\n"
        assert rendered[True].endswith("<|im_end|>\n<|im_start|>assistant\n") and "Find the sum" in rendered[True]
        plain = Aime25(root=str(FIXTURES / "aime25"), thinking=False).build(smollm2_tokenizer, 8000, False)[0]
        assert plain.chat_template_kwargs == {}  # no chat template, nothing to switch
    finally:
        smollm2_tokenizer.chat_template = before
    with caplog.at_level(logging.WARNING, logger="kvbench.data.reasoning"):
        Aime25(root=str(FIXTURES / "aime25"), thinking=False).build(smollm2_tokenizer, 8000, True)
    assert "has no enable_thinking switch" in caplog.text  # SmolLM2's own template


def test_gsm8k_few_shot_context_is_the_agnostic_context(smollm2_tokenizer):
    sample = Gsm8k(root=str(FIXTURES / "gsm8k")).build(smollm2_tokenizer)[0]
    ids, n_context = prompt_split(sample, smollm2_tokenizer, SimpleNamespace(chat_template=False,
                                                                             max_prompt_tokens=8000))
    assert sample.prompt[sample.context_end:].startswith("Question: Mira bakes")
    assert 0 < n_context < len(ids) and smollm2_tokenizer.decode(ids[n_context:]).lstrip().startswith("Question:")
    assert Gsm8k(root=str(FIXTURES / "gsm8k"), num_fewshot=0).build(None)[0].context_end is None


def test_download_script_writes_what_the_builders_read(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import download_reasoning as script
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    hub = {("openai/gsm8k", "test"): [{"question": "One plus one?", "answer": "1 + 1 = 2\n#### 2"}],
           ("openai/gsm8k", "train"): [{"question": f"{i} plus 0?", "answer": f"#### {i}"} for i in range(5)],
           ("yentinglin/aime_2025", "train"): [{"id": 0, "question": "Find $7 \\cdot 8$.", "answer": 56, "extra": 1}]}
    asked = []
    monkeypatch.setattr(script, "load_rows", lambda repo, config, split, revision: asked.append(
        (repo, config, split, revision)) or hub[(repo, split)])
    monkeypatch.setattr(script, "resolve_revision", lambda repo, revision: "c0ffee")
    assert script.main(["gsm8k", "aime25", "--out", str(tmp_path), "--revision", "v1"]) == 0
    # read at the commit "v1" resolves to
    assert ("openai/gsm8k", "main", "test", "c0ffee") in asked
    assert ("yentinglin/aime_2025", None, "train", "c0ffee") in asked
    aime = Aime25(root=str(tmp_path / "aime25"), prompt="kvpress").build(None)
    assert aime[0].prompt == "Find $7 \\cdot 8$." and aime[0].answers == ["56"]  # question -> problem, answer str
    assert json.loads((tmp_path / "aime25" / "test.jsonl").read_text()) == {"id": 0, "problem": "Find $7 \\cdot 8$.",
                                                                          "answer": "56"}
    provenance = json.loads((tmp_path / "aime25" / "provenance.json").read_text())
    assert provenance["revision"] == "v1" and provenance["resolved_revision"] == "c0ffee"
    assert provenance["source"] == "yentinglin/aime_2025" and provenance["rows"] == {"test": 1}
    gsm = Gsm8k(root=str(tmp_path / "gsm8k")).build(None)
    assert gsm[0].prompt.endswith("Question: One plus one?\nAnswer:") and gsm[0].prompt.count("Question:") == 6


@pytest.mark.parametrize("make,message", [
    (lambda: Math500(root="/nonexistent").check(), "math500: /nonexistent/ lacks test.jsonl; run `python scripts/"),
    (lambda: Gsm8k(root=str(FIXTURES / "aime25")).check(), "gsm8k: "),  # no train.jsonl for the 5 examples
    (lambda: Gsm8k(protocol="gsm8k_cot", num_fewshot=9), "gsm8k: num_fewshot=9 must be in [0, 8]"),
    (lambda: Gsm8k(protocol="gsm8k-cot"), "gsm8k: protocol='gsm8k-cot' is not one of gsm8k, gsm8k_cot"),
    (lambda: Aime25(samples=0), "aime25: samples=0 must be >= 1"),
    (lambda: Aime25(prompt="plain"), "aime25: prompt='plain' is not one of rkv, r1, kvpress"),
])
def test_bad_input_is_one_line(make, message):
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        make()
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_thinking_without_a_chat_template_is_refused_before_weights(tmp_path):
    line = refusal("model=tiny_llama", "dataset=aime25", f"dataset.root={FIXTURES / 'aime25'}",
                   "dataset.thinking=false", results=tmp_path)
    assert "dataset.thinking=False is the chat template's thinking switch" in line
    assert "set model.chat_template=true" in line


@pytest.mark.parametrize("dataset,extra", [
    ("gsm8k", ["dataset.samples=2", "generation.do_sample=true", "generation.temperature=0.6",
               "generation.top_p=0.95", "model.chat_template=true", "dataset.thinking=false"]),
    ("math500", ["method=h2o", "budget=24"]),  # decode-time eviction while it generates
    ("aime24", []),
    ("aime25", []),
])
def test_each_set_runs_end_to_end_on_its_fixture(dataset, extra, tmp_path):
    args = ["model=tiny_llama", f"dataset={dataset}", f"dataset.root={FIXTURES / dataset}", "dataset.max_new_tokens=16",
            "limit=2", "report=false", *extra]
    if not any(a.startswith("method=") for a in extra):
        args += ["method=snapkv", "budget=64"]
    run_dir = run_here(*args, results=tmp_path)
    recs = records(run_dir)
    scores = json.loads((run_dir / "scores.json").read_text())
    primary = scores["primary_metric"]
    assert len(recs) == 2 and all(0 < r["new_tokens"] <= 16 for r in recs) and scores["n"] == 2
    pass1 = scores["reasoning"]["pass@1"][primary]
    assert pass1["mean"] == pytest.approx(np.mean([r["scores"][primary] for r in recs]))
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["dataset"] == dataset and manifest["versions"]["math-verify"] == "0.9.0"
    if dataset == "gsm8k":  # one problem, two samples with their own seeds
        assert [r["id"] for r in recs] == ["gsm8k-0000#0", "gsm8k-0000#1"] and pass1["n_problems"] == 1
        assert set(recs[0]["scores"]) == {"strict_match", "flexible_extract"}
        assert recs[0]["prompt_tokens"] > 300  # five examples in SmolLM2's chat turn
    else:
        assert set(recs[0]["scores"]) == {"math_verify", "answered"} and pass1["n_problems"] == 2
    if dataset == "aime25":
        assert manifest["dataset_provenance"]["revision"] == "fixture"
    if dataset == "math500":
        assert all(r["effective_budget"] <= 24 + 1 for r in recs)
