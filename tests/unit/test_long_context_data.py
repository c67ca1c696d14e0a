"""LongBench v2, ZeroSCROLLS and LooGLE (issue 35): prompts byte for byte against the reference files, the loaders on
their look-alike fixtures, the scorers against values the reference code computed (tests/fixtures/*_golden.json say
how), the download script's files, one-line refusals, and one run end to end on the tiny random model."""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from kvbench.data.longbench_v2 import COT_ANSWER_TEMPLATE, TEMPLATE_0SHOT, TEMPLATE_COT, LongBenchV2, result_table
from kvbench.metrics.longbench_v2 import extract_answer, kvpress_match

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"


def sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def script(name: str):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(ROOT / "scripts"))


# --- LongBench v2 ---------------------------------------------------------------------------------------------------
def test_longbench_v2_templates_are_the_upstream_files():
    """sha256 of THUDM/LongBench @ 2e00731 prompts/0shot.txt, 0shot_cot.txt, 0shot_cot_ans.txt (read with git show)."""
    assert sha(TEMPLATE_0SHOT) == "68a162252bc9ff71d5d7abca3d69bb31aac3c35f832d657a2866f2018b8a6950"
    assert sha(TEMPLATE_COT) == "6cc33d92fd8f611662b756c1f10f302c541ca005b58c46d5f3188ac3a939bfe8"
    assert sha(COT_ANSWER_TEMPLATE) == "85ec59df4ac0e27aabbc619a7ca5cf3ae1787dd5a76cf51a18944eb52c91955f"


def test_longbench_v2_extraction_equals_the_reference_on_goldens():
    cases = json.loads((FIXTURES / "longbench_v2_golden.json").read_text(encoding="utf-8"))["cases"]
    assert len(cases) >= 15 and {c["judge"] for c in cases} == {True, False}
    assert any(c["judge"] != c["kvpress"] for c in cases)  # the two judges differ on some
    for c in cases:
        assert extract_answer(c["response"]) == c["pred"], c
        assert kvpress_match(c["response"], c["answer"]) == c["kvpress"], c


def test_longbench_v2_builds_the_fixture(smollm2_tokenizer):
    samples = LongBenchV2(root=str(FIXTURES / "longbench_v2")).build(smollm2_tokenizer, 100_000)
    first = samples[0]
    assert [s.id for s in samples] == [f"longbench_v2-66f0a1b2c3d4e5f6a7b8c9d{i}" for i in range(3)]
    assert first.prompt.startswith("Please read the following text and answer the question below.\n\n<text>\nThe "
                                   "lighthouse")  # the document stripped, as pred.py
    assert "question: Which colour was the lighthouse painted after the storm?\nChoices:\n(A) Red\n(B) White\n" \
           in first.prompt and first.answers == ["C"] and first.max_new_tokens == 128
    assert first.meta["difficulty"] == "easy" and first.meta["length"] == "short"
    assert first.prompt[first.context_end:].startswith("What is the correct answer")
    question = smollm2_tokenizer.decode(first.input_ids[first.context_tokens:])  # "\n\n" is one token: the question's
    assert question.startswith("\n\nWhat is the correct") and "lighthouse on" not in question
    # chat template on: the user turn of SmolLM2's template; the split stays inside it
    chat = LongBenchV2(root=str(FIXTURES / "longbench_v2"), prompt="cot").build(smollm2_tokenizer, 100_000, True)[0]
    assert chat.prompt.endswith("Let’s think step by step:<|im_end|>\n<|im_start|>assistant\n")
    assert chat.max_new_tokens == 1024 and chat.prompt[chat.context_end:].startswith("What is the correct answer")
    # a middle cut keeps ids[:max // 2] + ids[-max // 2:] (floor: one more at the end for an odd limit)
    cut = LongBenchV2(root=str(FIXTURES / "longbench_v2")).build(smollm2_tokenizer, 41)[0]
    full_ids = smollm2_tokenizer.encode(LongBenchV2(root=str(FIXTURES / "longbench_v2")).build(
        smollm2_tokenizer, 100_000)[0].prompt)
    expected = smollm2_tokenizer.decode(full_ids[:20] + full_ids[-21:], skip_special_tokens=True)
    assert cut.meta["truncated"] and cut.prompt == expected


def test_longbench_v2_kvpress_reading(smollm2_tokenizer):
    sample = LongBenchV2(root=str(FIXTURES / "longbench_v2"), prompt="kvpress").build(smollm2_tokenizer, 100_000)[0]
    assert sample.max_new_tokens == 16
    assert sample.prompt.startswith("<|im_start|>Please read the following text and answer the question below.\n"
                                    "<text>\n\nThe lighthouse")  # bos + context, nothing stripped
    assert sample.prompt.endswith("\"The correct answer is (insert answer here).\n")  # question + "\n" + no prefix
    context_ids = smollm2_tokenizer.encode(sample.prompt[:sample.context_end], add_special_tokens=False)
    assert list(sample.input_ids[:sample.context_tokens]) == context_ids  # two pieces, each tokenized alone
    ds = LongBenchV2(prompt="kvpress")
    assert ds.score(sample, "The correct answer is (A). No: The correct answer is (C)") == {"accuracy": 1.0}
    assert LongBenchV2().score(sample, "The correct answer is (A). No: The correct answer is (C)") == {
        "accuracy": 0.0, "answered": 1.0}


def test_longbench_v2_result_table_is_result_py():
    recs = [{"scores": {"accuracy": a}, "meta": {"difficulty": d, "length": n}}
            for a, d, n in [(1.0, "easy", "short"), (0.0, "hard", "short"), (1.0, "hard", "medium"),
                            (0.0, "hard", "long"), (1.0, "easy", "long"), (1.0, "hard", "long")]]
    table = result_table(recs)
    assert table["scores"] == {"Overall": 66.7, "Easy": 100.0, "Hard": 50.0, "Short": 50.0, "Medium": 100.0,
                               "Long": 66.7}
    assert table["n"]["Hard"] == 4 and result_table(recs[:1])["scores"]["Hard"] is None


@pytest.mark.parametrize("make,message", [
    (lambda: LongBenchV2(prompt="cot2"), "longbench_v2: Unknown prompt 'cot2'"),
    (lambda: LongBenchV2(difficulty=["medium"]), "longbench_v2: difficulty has 'medium'; use some of easy, hard"),
    (lambda: LongBenchV2(root="/nonexistent").check(), "longbench_v2: /nonexistent/ lacks data.jsonl; run `python "),
])
def test_bad_input_is_one_line(make, message):
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        make()
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_download_script_writes_what_the_builders_read(tmp_path, monkeypatch, smollm2_tokenizer):
    dl = script("download_long_context")
    records = [json.loads(line) for line in (FIXTURES / "longbench_v2" / "data.jsonl").read_text().splitlines()]
    asked = []
    monkeypatch.setattr(dl, "resolve_revision", lambda repo, revision: "c0ffee" + "0" * 34)
    monkeypatch.setattr(dl, "load_files", lambda builder, files, split: asked.append((builder, files, split))
                        or [{**r, "extra": 1} for r in records])
    assert dl.main(["longbench_v2", "--out", str(tmp_path)]) == 0
    assert asked == [("json", "hf://datasets/THUDM/LongBench-v2@c0ffee" + "0" * 34 + "/data.json", "train")]
    built = LongBenchV2(root=str(tmp_path / "longbench_v2")).build(smollm2_tokenizer)
    assert [s.answers for s in built] == [["C"], ["B"], ["D"]]
    provenance = json.loads((tmp_path / "longbench_v2" / "provenance.json").read_text())
    assert provenance["revision"] == "main" and provenance["resolved_revision"].startswith("c0ffee")
    assert provenance["rows"] == {"data": 3} and set(provenance["files"]) == {"data.jsonl"}


def test_longbench_v2_runs_end_to_end_and_the_report_scores_it(tmp_path):
    from kvbench.report.__main__ import main as report_main
    from tests.unit.test_cli import records, run_here

    run_dir = run_here("model=tiny_llama", "dataset=longbench_v2", f"dataset.root={FIXTURES / 'longbench_v2'}",
                       "dataset.max_new_tokens=4", "method=snapkv", "budget=64", "query=agnostic", "report=false",
                       results=tmp_path / "results")
    recs = records(run_dir)
    scores = json.loads((run_dir / "scores.json").read_text())
    assert len(recs) == 3 and scores["primary_metric"] == "accuracy"
    assert all(set(r["scores"]) == {"accuracy", "answered"} and r["new_tokens"] <= 4 for r in recs)
    assert scores["longbench_v2"]["n"] == {"Overall": 3, "Easy": 1, "Hard": 2, "Short": 1, "Medium": 1, "Long": 1}
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["dataset"] == "longbench_v2" and manifest["dataset_provenance"]["revision"] == "fixture"
    assert report_main([str(tmp_path / "results"), "--out", str(tmp_path / "report")]) == 0
    table = (tmp_path / "report" / "query-agnostic" / "longbench_v2_table.md").read_text()
    assert "| Overall | Easy | Hard | Short | Medium | Long |" in table and "| SnapKV | 64 | agnostic | 3 |" in table


# --- ZeroSCROLLS ----------------------------------------------------------------------------------------------------
def test_zero_scrolls_metrics_equal_the_reference_on_goldens():
    from kvbench.metrics import zero_scrolls as zs

    golden = json.loads((FIXTURES / "zero_scrolls_golden.json").read_text(encoding="utf-8"))
    fns = {**zs.SCORERS, "exact_match": zs.exact_match}
    for metric, cases in golden.items():
        if metric == "how":
            continue
        for c in cases:
            assert zs.best_over_references(fns[metric], c["prediction"], c["references"]) == pytest.approx(
                c["value"], abs=1e-12), (metric, c)


def test_zero_scrolls_builds_the_fixture_both_ways(smollm2_tokenizer):
    from kvbench.data.zero_scrolls import ZeroScrolls

    root = str(FIXTURES / "zero_scrolls")
    samples = ZeroScrolls(root=root).build(smollm2_tokenizer, 100_000)
    assert len(samples) == 10 and {s.meta["task"] for s in samples} == set(ZeroScrolls().tasks)
    qasper = next(s for s in samples if s.meta["task"] == "qasper")
    assert qasper.answers == ["12,000 Welsh sentences", "12,000"] and qasper.max_new_tokens == 128
    record = json.loads((FIXTURES / "zero_scrolls" / "qasper_validation.jsonl").read_text().splitlines()[0])
    assert qasper.prompt == record["input"] and qasper.context_end == record["document_end_index"]
    assert smollm2_tokenizer.decode(qasper.input_ids[qasper.context_tokens:]).lstrip().startswith("Question:")
    # the reference's cut: the head of the text before the query, then separator + query, `limit` tokens in all
    cut = ZeroScrolls(root=root, tasks=["qasper"]).build(smollm2_tokenizer, 30)[0]
    tail = smollm2_tokenizer(record["truncation_seperator"] + record["input"][record["query_start_index"]:],
                             add_special_tokens=False).input_ids
    assert len(cut.input_ids) == 30 and list(cut.input_ids[-len(tail):]) == tail and cut.meta["truncated"]
    # kvpress: context / question / stripped answer prefix, two pieces
    kv = ZeroScrolls(root=root, tasks=["qasper"], protocol="kvpress").build(smollm2_tokenizer, 100_000, True)[0]
    assert kv.prompt.endswith("How many sentences are used for training?<|im_end|>\n<|im_start|>assistant\nAnswer:")
    assert kv.prompt[:kv.context_end].endswith("Corpus of Welsh Tides.")


def test_zero_scrolls_scores_and_summary():
    from kvbench.data.base import Sample
    from kvbench.data.zero_scrolls import ZeroScrolls

    ds = ZeroScrolls()
    gov = Sample("g", "", ["the board approved a fee rise"], 8, meta={"task": "gov_report"})
    s = ds.score(gov, "The board approved a fee rise.")
    assert s["rouge1"] == s["rouge2"] == s["rougeL"] == 1.0 and s["zero_scrolls"] == pytest.approx(1.0)
    half = ds.score(gov, "the board approved")  # r1 = r2-ish partial: geometric mean of the three F-measures
    assert half["zero_scrolls"] == pytest.approx((half["rouge1"] * half["rouge2"] * half["rougeL"]) ** (1 / 3))
    sort = Sample("b", "", ["2, 1, 3"], 8, meta={"task": "book_sum_sort"})
    assert ds.score(sort, "1, 2, 3") == {"zero_scrolls": pytest.approx(2 / 3)}
    recs = [{"meta": {"task": "gov_report"}, "scores": {"zero_scrolls": 0.0, "rouge1": r1, "rouge2": r2, "rougeL": rl}}
            for r1, r2, rl in [(0.5, 0.2, 0.4), (0.3, 0.1, 0.2)]]
    recs.append({"meta": {"task": "quality"}, "scores": {"zero_scrolls": 1.0}})
    out = ds.summarize(recs)["zero_scrolls"]
    assert out["tasks"]["gov_report"] == pytest.approx(100 * (0.4 * 0.15 * 0.3) ** (1 / 3))
    assert out["avg"] == pytest.approx((out["tasks"]["gov_report"] + 100) / 2)


# --- LooGLE ---------------------------------------------------------------------------------------------------------
def test_loogle_and_kvpress_templates_are_the_upstream_ones():
    """sha256 of json.dumps(sort_keys=True) of bigai-nlco/LooGLE @ 6734382 config/task2prompt.json as parsed, of
    kvpress @ 8bb29b9 loogle/create_huggingface_dataset.py's three template dicts, and of its LongBench-v2 templates."""
    from kvbench.data.longbench_v2 import KVPRESS_CONTEXT, KVPRESS_QUESTION
    from kvbench.data.loogle import KVPRESS, TASK2MAXLEN, TASK2PROMPT

    assert sha(json.dumps(TASK2PROMPT, sort_keys=True)) == (
        "b688e103dc3f6425533e61e5e7ba3a4f6368d701942c2fe4c788b2487d8c327e")
    kv = [{t: v[i] for t, v in KVPRESS.items()} for i in range(3)]
    assert sha(json.dumps(kv, sort_keys=True)) == "a034a19b11f4aa29c23a35bc1e1b7fa97ac653777c4e2544bf77475da7835a3d"
    assert sha(KVPRESS_CONTEXT + KVPRESS_QUESTION) == (
        "e3a01ce739a6356f733557988a7009276cf637d87a323180381809e41711b377")
    assert TASK2MAXLEN == {"shortdep_qa": 300, "longdep_qa": 500, "longdep_summarization": 500, "shortdep_cloze": 50}


def test_loogle_metrics_equal_the_reference_on_goldens():
    from kvbench.metrics.loogle import cloze_matches, generation_scores

    golden = json.loads((FIXTURES / "loogle_golden.json").read_text(encoding="utf-8"))
    for c in golden["generation"]:
        got = generation_scores(c["reference"], c["prediction"])
        assert got == pytest.approx({k: c[k] for k in got}, abs=1e-12), c
    for c in golden["cloze"]:
        exact, n_exact, partial, n_partial = cloze_matches(c["reference"], c["prediction"])
        assert [exact, n_exact] == c["exact"] and [partial, n_partial] == c["partial"], c
        exact, n_exact, partial, n_partial = cloze_matches(c["reference"], c["prediction"], kvpress=True)
        assert [exact, n_exact] == c["kvpress_exact"] and [partial, n_partial] == c["kvpress_partial"], c
    assert generation_scores("Tobias Wren", "") == generation_scores("Tobias Wren", "None")  # automatic_eval.py


def test_loogle_builds_the_fixture_and_scores(smollm2_tokenizer):
    from kvbench.data.loogle import LooGLE

    samples = LooGLE(root=str(FIXTURES / "loogle")).build(smollm2_tokenizer, 100_000)
    assert [s.id for s in samples] == ["shortdep_qa-0-0", "shortdep_qa-0-1", "longdep_qa-0-0", "shortdep_cloze-0-0",
                                       "longdep_summarization-0"]
    qa, cloze, summary = samples[0], samples[3], samples[4]
    assert qa.prompt.startswith("Please answer the question based on the long texts below. \nMarrow Point")
    assert qa.prompt.endswith("\nQuestion: Who kept the lighthouse for forty years?\nAnswer: ")
    assert qa.prompt[qa.context_end:].startswith("\nQuestion:") and qa.max_new_tokens == 300
    assert "for example: {'<mask-0>': 'Bob'," in cloze.prompt and cloze.prompt.endswith("masked entities? \nAnswer:")
    assert json.loads(cloze.answers[0]) == {"<mask-0>": "Marrow Point", "<mask-1>": "Ada Voss"}
    assert summary.prompt.endswith("\n Summarization: ") and summary.answers[0].startswith("A note on")
    ds = LooGLE()
    scores = ds.score(cloze, "{'<mask-0>': 'Marrow Point', '<mask-1>': 'Voss'}")
    assert scores["loogle"] == scores["exact_match"] == 0.5 and scores["partial_match"] == 1.0
    assert ds.score(qa, "Ada Voss")["loogle"] == 1.0  # ROUGE-L recall
    recs = [{"meta": {"task": "shortdep_cloze"}, "scores": ds.score(cloze, p)}
            for p in ("{'<mask-0>': 'Marrow Point', '<mask-1>': 'Voss'}", "no dict")]
    assert ds.summarize(recs)["loogle"]["tasks"]["shortdep_cloze"] == {"exact_match": 0.25, "partial_match": 0.5}
    kv = LooGLE(root=str(FIXTURES / "loogle"), tasks=["shortdep_cloze"], protocol="kvpress").build(
        smollm2_tokenizer, 100_000, True)[0]
    assert kv.prompt.endswith("What are the masked entities?\n<|im_end|>\n<|im_start|>assistant\nAnswer:")
    assert LooGLE(protocol="kvpress").score(kv, "no dict")["exact_masks"] == 1.0  # kvpress counts 1 mask


@pytest.mark.parametrize("make,message", [
    (lambda: __import__("kvbench.data.loogle", fromlist=["x"]).LooGLE(tasks=["shortdep"]),
     "loogle: Unknown task 'shortdep'. Did you mean: shortdep_qa?"),
    (lambda: __import__("kvbench.data.zero_scrolls", fromlist=["x"]).ZeroScrolls(tasks=["qasperr"]),
     "zero_scrolls: Unknown task 'qasperr'. Did you mean: qasper?"),
    (lambda: __import__("kvbench.data.zero_scrolls", fromlist=["x"]).ZeroScrolls(root="/nonexistent").check(),
     "zero_scrolls: /nonexistent/ lacks gov_report_validation.jsonl"),
])
def test_loogle_and_zero_scrolls_refuse_in_one_line(make, message):
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        make()
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_download_script_reads_the_parquet_exports_at_the_pinned_commit(tmp_path, monkeypatch, smollm2_tokenizer):
    from kvbench.data.loogle import LooGLE
    from kvbench.data.zero_scrolls import ZeroScrolls

    dl = script("download_long_context")
    commit = "c0ffee" + "0" * 34
    asked = []

    def fixture_rows(builder, files, split):
        asked.append((builder, files, split))
        name, task = ("zero_scrolls", files.split("/")[-3]) if "zero_scrolls" in files else ("loogle",
                                                                                            files.split("/")[-3])
        stem = f"{task}_validation" if name == "zero_scrolls" else task
        return [json.loads(line) for line in (FIXTURES / name / f"{stem}.jsonl").read_text().splitlines()]

    monkeypatch.setattr(dl, "resolve_revision", lambda repo, revision: commit)
    monkeypatch.setattr(dl, "load_files", fixture_rows)
    assert dl.main(["zero_scrolls", "loogle", "--out", str(tmp_path)]) == 0
    assert ("parquet", f"hf://datasets/tau/zero_scrolls@{commit}/qasper/validation/*.parquet", "validation") in asked
    assert ("parquet", f"hf://datasets/bigainlco/LooGLE@{commit}/shortdep_cloze/test/*.parquet", "test") in asked
    zs = ZeroScrolls(root=str(tmp_path / "zero_scrolls"), tasks=["qasper"]).build(smollm2_tokenizer, 100_000)
    assert zs[0].answers == ["12,000 Welsh sentences", "12,000"]
    assert len(LooGLE(root=str(tmp_path / "loogle")).build(smollm2_tokenizer, 100_000)) == 5
    provenance = json.loads((tmp_path / "loogle" / "provenance.json").read_text())
    assert provenance["revision"] == "refs/convert/parquet" and provenance["resolved_revision"] == commit
    assert provenance["rows"]["shortdep_qa"] == 1 and len(provenance["files"]) == 4


def test_scores_json_averages_each_metric_over_the_samples_that_have_it():
    """LooGLE's cloze samples have match scores, its QA samples BLEU/ROUGE: each mean is over its own samples."""
    from kvbench.runs.store import aggregate

    base = {"kv_bytes": 1, "full_kv_bytes": 2, "effective_budget": 8, "prefill_s": 0.1, "decode_tok_s": 5.0}
    recs = [{**base, "id": "a", "score": 0.5, "scores": {"loogle": 0.5, "rougeL": 0.5}},
            {**base, "id": "b", "score": 0.25, "scores": {"loogle": 0.25, "exact_match": 0.25}},
            {**base, "id": "c", "score": 1.0, "scores": {"loogle": 1.0, "rougeL": 1.0}}]
    out = aggregate(recs)
    assert out["metrics"] == {"loogle": pytest.approx(1.75 / 3), "rougeL": 0.75, "exact_match": 0.25}
    assert out["stats"]["rougeL"]["n"] == 2 and out["stats"]["exact_match"]["n"] == 1
