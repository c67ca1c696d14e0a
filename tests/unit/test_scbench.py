"""SCBench: templates pinned to upstream, prompts and ids built as upstream's `create_multiturn_prompt` /
`create_scdq_prompt` + `truncate_by_tokens` build them, scorers equal upstream's compute_scores.py, one-line errors,
and `dataset=scbench` running on the self-written fixtures with the tiny model.

Golden scores (`UPSTREAM_SCORES`): produced by running upstream's own functions. Recipe: `git show
fb56c91:scbench/compute_scores.py` from microsoft/MInference; parse it with `ast`, exec only its top-level `def`s in a
namespace holding `re`, `string`, `Counter` and, for `ROUGE_SCORER` (module-level `evaluate.load("rouge")`, which
needs the Hub), an object whose `compute(predictions, references, use_aggregator=False)` returns
`{"rougeLsum": [RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"], use_stemmer=False).score(ref, pred)
.rougeLsum.fmeasure]}` (what evaluate's rouge.py does with its defaults, rouge_score 0.1.2); then
`get_score_one(pred, label, Multiturnbench_to_Infinitebench.get(task, task), "m")` for each case in `CASES`.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pandas as pd
import pytest

from kvbench.data.base import middle_cut
from kvbench.data.scbench import SCBench
from kvbench.data.scbench_prompts import CONTEXT_ONLY, FIRST_TURN, FOLLOW_UP, FOLLOW_UP_CHAT, MAX_NEW_TOKENS, TASKS
from kvbench.metrics.scbench import score_turn

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "scbench"

# sha256[:16] of each template as upstream's eval_utils.py (fb56c91) holds it; scdq qa/choice pairs joined by "\0"
UPSTREAM_SHA = {
    "first": {"scbench_kv": "afa97419dd69cd74", "scbench_prefix_suffix": "0f6aea3c6a209f7c",
              "scbench_qa_eng": "6f24f4abaf415845", "scbench_choice_eng": "96278d2a90c10fbd",
              "scbench_many_shot": "0f6aea3c6a209f7c", "scbench_summary": "0f6aea3c6a209f7c"},
    "follow": {"scbench_kv": "ce773ac63a95be25", "scbench_prefix_suffix": "ce773ac63a95be25",
               "scbench_qa_eng": "bdec8315531390b3", "scbench_choice_eng": "18e7e0357dab9af1",
               "scbench_many_shot": "ce773ac63a95be25", "scbench_summary": "ce773ac63a95be25"},
    "chat": {"scbench_kv": "5e1df29a7d7beef0", "scbench_prefix_suffix": "5e1df29a7d7beef0",
             "scbench_qa_eng": "4ec52b8bd55238a9", "scbench_choice_eng": "bca45d99666a76e1",
             "scbench_many_shot": "5e1df29a7d7beef0", "scbench_summary": "5e1df29a7d7beef0"},
    "scdq": {"scbench_kv": "8c3661a0959db082", "scbench_prefix_suffix": "779f2c0f2bff58e3",
             "scbench_qa_eng": "3d9de5ef3e3f8c0e", "scbench_choice_eng": "67e4396c52322280",
             "scbench_many_shot": "779f2c0f2bff58e3", "scbench_summary": "779f2c0f2bff58e3"},
}


SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def records(task: str) -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / f"{task}.jsonl").read_text().splitlines()]


def test_templates_and_lengths_match_upstream():
    scdq = {t: sha(CONTEXT_ONLY[t] + "\0" + FOLLOW_UP_CHAT[t]) if t in ("scbench_qa_eng", "scbench_choice_eng")
            else sha(CONTEXT_ONLY[t]) for t in TASKS}
    assert {"first": {t: sha(FIRST_TURN[t]) for t in TASKS}, "follow": {t: sha(FOLLOW_UP[t]) for t in TASKS},
            "chat": {t: sha(FOLLOW_UP_CHAT[t]) for t in TASKS}, "scdq": scdq} == UPSTREAM_SHA
    assert MAX_NEW_TOKENS == {"scbench_kv": 150, "scbench_prefix_suffix": 150, "scbench_qa_eng": 40,
                              "scbench_choice_eng": 40, "scbench_many_shot": 10, "scbench_summary": 200}


def by_id(samples):
    return {s.id: s for s in samples}


def test_multi_turn_prompts_without_chat_template(smollm2_tokenizer):
    tok = smollm2_tokenizer
    kv = records("scbench_kv")[0]
    t = kv["multi_turns"]
    samples = by_id(SCBench(root=str(FIXTURES), tasks=["scbench_kv"]).build(tok, 8000))
    first = ("Extract the value corresponding to the specified key in the JSON object below.\n\n"
             + kv["context"] + "\n\n" + t[0]["input"])
    second = t[0]["answer"] + "\n\n" + t[1]["input"]  # the previous turn's *reference* answer, then the question
    third = t[1]["answer"] + "\n\n" + t[2]["input"]
    assert samples["scbench_kv-0-t0"].prompt == first
    assert samples["scbench_kv-0-t2"].prompt == first + second + third
    # each segment tokenized on its own: the first with special tokens, the rest without (upstream _process_texts)
    want = tok.encode(first) + tok.encode(second, add_special_tokens=False) + tok.encode(third, add_special_tokens=False)
    s2 = samples["scbench_kv-0-t2"]
    assert list(s2.input_ids) == want and s2.max_new_tokens == 150 and s2.answers == [t[2]["answer"]]
    assert s2.meta == {"task": "scbench_kv", "index": 0, "turn": 2, "n_turns": 3, "mode": "multi_turn",
                       "prefix_tokens": len(want) - len(tok.encode(third, add_special_tokens=False)),
                       "truncated": False}

    book = records("scbench_choice_eng")[0]
    c = book["multi_turns"]
    choice = by_id(SCBench(root=str(FIXTURES), tasks=["scbench_choice_eng"]).build(tok, 8000))
    assert choice["scbench_choice_eng-0-t1"].prompt == (
        "Read the book and answer the question.\n\n" + book["context"] + "\n\nQuestion: How many steps led to the "
        "lamp?\nA. Forty\nB. One hundred and four\nC. Eleven\nD. Six\n\nThe the correct answer is"
        "One hundred and four\n\nQuestion: What broke in the March storm?\nA. The boat\nB. The stairs\n"
        "C. The great lens\nD. The door\n\nThe letter of the correct answer is")
    assert choice["scbench_choice_eng-0-t1"].meta["letter"] == "C" and c[1]["answer"] == "The great lens"
    qa = by_id(SCBench(root=str(FIXTURES), tasks=["scbench_qa_eng"]).build(tok, 8000))
    story = records("scbench_qa_eng")[0]["context"]
    assert qa["scbench_qa_eng-0-t1"].prompt == (
        "Read the book and answer the question. Be very concise in your answer.\n\n" + story
        + "\n\nQuestion: Who kept the lighthouse on Gannet Rock?\nAnswer:Mira Vell\n\n"
        "Question: What was the name of Osric's boat?\nAnswer:")


def test_scdq_prompts_without_and_with_chat_template(smollm2_tokenizer):
    tok = smollm2_tokenizer
    kv = records("scbench_kv")[0]
    q1 = kv["multi_turns"][1]["input"]
    plain = by_id(SCBench(root=str(FIXTURES), tasks=["scbench_kv"], mode="scdq").build(tok, 8000))
    context = "Extract the value corresponding to the specified key in the JSON object below.\n\n" + kv["context"]
    s = plain["scbench_kv-0-t1"]
    assert s.prompt == context + q1  # no separator: upstream concatenates the two id lists
    assert list(s.input_ids) == tok.encode(context) + tok.encode(q1, add_special_tokens=False)
    assert s.meta["prefix_tokens"] == len(tok.encode(context))
    # SmolLM2's template (its default system turn when none is given): the context ends inside the open user turn,
    # each query closes it
    chat = by_id(SCBench(root=str(FIXTURES), tasks=["scbench_kv"], mode="scdq").build(tok, 8000, chat_template=True))
    head = SMOL_SYSTEM + "<|im_start|>user\n" + context
    tail = q1 + "<|im_end|>\n<|im_start|>assistant\n"
    assert chat["scbench_kv-0-t1"].prompt == head + tail
    assert list(chat["scbench_kv-0-t1"].input_ids) == tok.encode(head) + tok.encode(tail, add_special_tokens=False)


def test_multi_turn_prompts_with_chat_template(smollm2_tokenizer):
    """Follow-ups are [system "", assistant <previous answer>, user <question>] rendered with the generation prompt,
    minus the rendering of [system ""] ("<|im_start|>system\\n<|im_end|>\\n<|im_start|>assistant\\n" here)."""
    tok = smollm2_tokenizer
    kv = records("scbench_kv")[0]
    t = kv["multi_turns"]
    s = by_id(SCBench(root=str(FIXTURES), tasks=["scbench_kv"]).build(tok, 8000, chat_template=True))
    first = (SMOL_SYSTEM + "<|im_start|>user\nExtract the value corresponding to the specified key in the JSON object below.\n\n"
             + kv["context"] + "\n\n" + t[0]["input"] + "<|im_end|>\n<|im_start|>assistant\n")
    follow = (t[0]["answer"] + "<|im_end|>\n<|im_start|>user\n" + t[1]["input"]
              + "<|im_end|>\n<|im_start|>assistant\n")
    assert s["scbench_kv-0-t0"].prompt == first and s["scbench_kv-0-t1"].prompt == first + follow
    paper = records("scbench_summary")[0]
    summ = by_id(SCBench(root=str(FIXTURES), tasks=["scbench_summary"]).build(tok, 8000, chat_template=True))
    assert summ["scbench_summary-0-t1"].prompt.endswith(
        paper["multi_turns"][0]["answer"] + "<|im_end|>\n<|im_start|>user\nNow list the sections of the paper."
        "<|im_end|>\n<|im_start|>assistant\nThis paper")  # upstream primes summary follow-ups in chat mode
    assert summ["scbench_summary-0-t1"].max_new_tokens == 200


def test_truncation_turns_and_limits(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert middle_cut(list(range(10)), 5) == [0, 1, 8, 9] and middle_cut(list(range(4)), -1) == [0, 1, 2, 3]
    kv = records("scbench_kv")[0]
    first = ("Extract the value corresponding to the specified key in the JSON object below.\n\n"
             + kv["context"] + "\n\n" + kv["multi_turns"][0]["input"])
    full = tok.encode(first)
    # max_input_length = max_seq_length - new tokens x turns: 560 - 150 x 3 = 110 ids kept of the first prompt
    ds = SCBench(root=str(FIXTURES), tasks=["scbench_kv"], max_seq_length=560, limit_per_task=1)
    samples = ds.build(tok, 8000)
    assert len(full) > 110 and list(samples[0].input_ids) == full[:55] + full[-55:]
    assert samples[0].meta["truncated"] and len(samples) == 3
    scdq = SCBench(root=str(FIXTURES), tasks=["scbench_kv"], mode="scdq", max_seq_length=1560, limit_per_task=1)
    ctx = tok.encode("Extract the value corresponding to the specified key in the JSON object below.\n\n"
                     + kv["context"])
    assert list(scdq.build(tok, 8000)[0].input_ids)[:110] == ctx[:55] + ctx[-55:]  # 1000 fewer in scdq mode
    two = SCBench(root=str(FIXTURES), tasks=["scbench_kv", "scbench_many_shot"], max_turns=2, max_new_tokens=4)
    out = two.build(tok, 8000)
    assert [s.id for s in out] == ["scbench_kv-0-t0", "scbench_kv-0-t1", "scbench_kv-1-t0", "scbench_kv-1-t1",
                                   "scbench_many_shot-0-t0", "scbench_many_shot-0-t1", "scbench_many_shot-1-t0",
                                   "scbench_many_shot-1-t1"]
    assert {s.max_new_tokens for s in out} == {4} and {s.meta["n_turns"] for s in out} == {2}
    conv = two.conversations(tok, 8000)[0]
    assert len(conv.turns) == 2 and list(out[1].input_ids) == conv.turn_ids(1)


CASES = [  # (task, prediction, label as get_ground_truth gives it)
    ("scbench_kv", " 1d89dc59-bc09<|eot_id|>", "1d89dc59-bc09"),
    ("scbench_kv", "The value is 1d89dc59-bc0", "1d89dc59-bc09"),
    ("scbench_kv", "1D89DC59-BC09", "1d89dc59-bc09"),
    ("scbench_prefix_suffix", "a3f2klmnop9c1.", "a3f2klmnop9c1"),
    ("scbench_qa_eng", "  It was mira vell.", ["Mira Vell"]),
    ("scbench_qa_eng", "Mira", ["Mira Vell"]),
    ("scbench_choice_eng", "B. One hundred and four", ["One hundred and four", "B"]),
    ("scbench_choice_eng", "One hundred and four", ["One hundred and four", "B"]),
    ("scbench_choice_eng", "I think the answer is: B", ["One hundred and four", "B"]),
    ("scbench_choice_eng", "the option is C", ["One hundred and four", "B"]),
    ("scbench_choice_eng", "", ["One hundred and four", "B"]),
    ("scbench_choice_eng", "maybe it is D or B", ["One hundred and four", "B"]),
    ("scbench_many_shot", "(B)", "(A)"),
    ("scbench_many_shot", "neutral", "positive"),
    ("scbench_many_shot", "xyz", "abc"),
    ("scbench_summary", "the cat sat on the mat", "the cat lay on the mat"),
    ("scbench_summary", "A lighthouse log shows March storms.\nRepairs follow fast.",
     "A lighthouse log over eleven winters shows March storms and quick repairs."),
    ("scbench_summary", "", "Weather, oil deliveries and repairs."),
    ("scbench_summary", "storms follow\nthe lens broke", "the lens broke and storms follow"),
]
UPSTREAM_SCORES = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.8333333333333334,
                   0.6666666666666666, 0.0, 0.9090909090909091]


@pytest.mark.parametrize("i", range(len(CASES)))
def test_scorers_equal_upstream(i):
    task, pred, label = CASES[i]
    assert score_turn(task, pred, label) == pytest.approx(UPSTREAM_SCORES[i], abs=1e-12)


def test_scorers_hand_worked():
    # rougeLsum: LCS "the cat on the mat" = 5 of 6 tokens each side -> P = R = F = 5/6
    assert score_turn("scbench_summary", "the cat sat on the mat", "the cat lay on the mat") == pytest.approx(5 / 6)
    # newline-split summary-level LCS: {storms follow} + {the lens broke} = 5 hits; P = 5/5, R = 5/6 -> F = 10/11
    # (one-string rougeL would give 3 hits: F = 6/11)
    assert score_turn("scbench_summary", "storms follow\nthe lens broke",
                      "the lens broke and storms follow") == pytest.approx(10 / 11)
    # many_shot's string label is iterated per character upstream ("T" of "positive" is in "NEUTRAL"); strict does not
    assert score_turn("scbench_many_shot", "neutral", "positive") == 1.0
    assert score_turn("scbench_many_shot", "neutral", "positive", "strict") == 0.0
    assert score_turn("scbench_many_shot", "Positive.", "positive", "strict") == 1.0


def test_score_and_summary_on_fixture_samples(smollm2_tokenizer):
    ds = SCBench(root=str(FIXTURES), tasks=["scbench_choice_eng", "scbench_qa_eng"])
    samples = ds.build(smollm2_tokenizer, 8000)
    s = by_id(samples)
    assert ds.score(s["scbench_choice_eng-1-t0"], "B") == {"scbench": 1.0}       # Green is option B
    assert ds.score(s["scbench_choice_eng-1-t0"], "A. Red") == {"scbench": 0.0}
    assert ds.score(s["scbench_qa_eng-1-t1"], " pell arden, the glazier") == {"scbench": 1.0}
    recs = [{"meta": x.meta, "scores": {"scbench": float(x.meta["turn"] == 0)}} for x in samples]
    out = ds.summarize(recs)["scbench"]
    assert out["turns"]["scbench_qa_eng"] == {"0": 100.0, "1": 0.0, "2": 0.0}
    assert out["tasks"] == {"scbench_choice_eng": 50.0, "scbench_qa_eng": 40.0}  # 2/4 and 2/5 turns
    assert out["n"] == {"scbench_choice_eng": 4, "scbench_qa_eng": 5} and out["avg"] == 45.0


def test_bad_input_and_missing_data(tmp_path):
    with pytest.raises(ValueError, match="scbench: Unknown task 'scbench_kvv'. Did you mean: scbench_kv"):
        SCBench(tasks=["scbench_kvv"])
    with pytest.raises(ValueError, match="scbench: Unknown mode 'multi'"):
        SCBench(mode="multi")
    with pytest.raises(ValueError, match="max_turns=0 must be a positive integer"):
        SCBench(max_turns=0)
    with pytest.raises(FileNotFoundError) as e:
        SCBench(root=str(tmp_path / "none")).check()
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"scbench: no folder {tmp_path / 'none'}/")
    assert "python scripts/download_scbench.py" in line and "make scbench-data" in line
    (tmp_path / "scbench_kv.jsonl").write_text("")
    with pytest.raises(FileNotFoundError, match=r"lacks scbench_qa_eng.jsonl; run `python scripts/download_scb"):
        SCBench(root=str(tmp_path), tasks=["scbench_kv", "scbench_qa_eng"]).check()
    (tmp_path / "scbench_kv.jsonl").write_text(json.dumps({"context": "c", "multi_turns": []}) + "\n")
    with pytest.raises(ValueError, match=r"scbench_kv.jsonl:1: 'multi_turns' must be a non-empty list"):
        SCBench(root=str(tmp_path), tasks=["scbench_kv"]).read_task("scbench_kv")


def test_cli_missing_folder_is_one_line(tmp_path):
    from tests.unit.test_cli import refusal

    line = refusal("model=tiny_llama", "dataset=scbench", f"dataset.root={tmp_path / 'none'}", results=tmp_path)
    assert "scbench: no folder" in line and "scripts/download_scbench.py" in line


def test_cli_runs_on_fixtures_with_tiny_model(tmp_path):
    """`dataset=scbench` composes and runs: one record per turn, its ids the turn's, per-turn summary in scores.json."""
    from tests.unit.test_cli import records as read_records
    from tests.unit.test_cli import run_here

    run_dir = run_here("model=tiny_llama", "method=snapkv", "budget=64", "dataset=scbench", f"dataset.root={FIXTURES}",
                       "dataset.tasks=[scbench_kv,scbench_choice_eng]", "dataset.limit_per_task=1",
                       "dataset.max_turns=2", "dataset.max_new_tokens=3", results=tmp_path)
    recs = read_records(run_dir)
    assert [r["id"] for r in recs] == ["scbench_kv-0-t0", "scbench_kv-0-t1", "scbench_choice_eng-0-t0",
                                       "scbench_choice_eng-0-t1"]
    assert all(r["new_tokens"] <= 3 and 0.0 <= r["score"] <= 1.0 for r in recs)
    assert recs[1]["prompt_tokens"] > recs[0]["prompt_tokens"]  # turn 1 holds turn 0's question and answer
    scores = json.loads((run_dir / "scores.json").read_text())["scbench"]
    assert set(scores["turns"]) == {"scbench_kv", "scbench_choice_eng"} and scores["mode"] == "multi_turn"
    from kvbench.report.__main__ import main as report

    assert report([str(tmp_path), "--out", str(tmp_path / "rep")]) == 0
    table = pd.read_csv(tmp_path / "rep" / "scbench_table.csv")
    kv = [r["score"] for r in recs if r["meta"]["task"] == "scbench_kv"]
    choice = [r["score"] for r in recs if r["meta"]["task"] == "scbench_choice_eng"]
    row = table.iloc[0]
    assert row["Retr.KV T2"] == pytest.approx(100 * kv[1]) and row["En.MultiChoice T1"] == pytest.approx(100 * choice[0])
    assert row["Avg."] == pytest.approx((100 * sum(kv) / 2 + 100 * sum(choice) / 2) / 2)



def scbench_greedy_search(model, segments: list[list[int]], max_new_tokens: int, scdq: bool = False):
    """An independent replay of upstream's `GreedySearch.test` (golden context) with transformers' own cache: prefill
    each turn's segment on the shared cache, decode greedily, then drop the decoded entries (upstream's
    `clear_temp_kv_cache`), so the next segment lands right after this one. `scdq` replays `test_scdq` instead:
    segment 0 (the context) is prefilled alone, and each query is dropped with its answer. Returns each turn's step
    logits."""
    import torch
    from transformers import DynamicCache

    cache, outputs = DynamicCache(), []
    with torch.no_grad():
        if scdq:
            model(input_ids=torch.tensor([segments[0]]), past_key_values=cache, use_cache=True)
            segments = segments[1:]
        for segment in segments:
            kept = cache.get_seq_length() + (0 if scdq else len(segment))
            logits = model(input_ids=torch.tensor([segment]), past_key_values=cache, use_cache=True).logits[0, -1]
            steps = [logits]
            for _ in range(max_new_tokens - 1):
                word = int(logits.argmax())
                logits = model(input_ids=torch.tensor([[word]]), past_key_values=cache, use_cache=True).logits[0, -1]
                steps.append(logits)
            if cache.get_seq_length() > kept:  # transformers 5: crop by a negative count
                cache.crop(kept - cache.get_seq_length())
            outputs.append(torch.stack(steps))
    return outputs


@pytest.mark.parametrize("mode", ["multi_turn", "scdq"])
def test_full_cache_turns_equal_scbench_replay(smollm2_tokenizer, mode):
    """With the full cache, each turn's sample gives the logits upstream's loop gets for that turn over its shared
    cache: a turn's sample holds exactly the ids SCBench's cache holds when the turn is asked."""
    import torch

    from kvbench.engine.batching import generate
    from kvbench.models import AttentionCapture
    from kvbench.models.loader import random_model
    from kvbench.registry import METHODS

    tok = smollm2_tokenizer
    model = random_model("llama", tok, seed=3).eval()
    ds = SCBench(root=str(FIXTURES), tasks=["scbench_kv"], limit_per_task=1, mode=mode)
    conv = ds.conversations(tok, 8000)[0]
    turns = conv.turns if mode == "scdq" else conv.turns[1:]  # multi_turn: turn 0's question is in segment 0
    want = scbench_greedy_search(model, [list(conv.context_ids)] + [list(t.ids) for t in turns], 3, mode == "scdq")
    samples = ds.build(tok, 8000)
    assert len(samples) == len(want) == 3
    for sample, ref in zip(samples, want):
        seen = []
        with AttentionCapture(model) as capture:
            generate(model, None, METHODS["full"](), capture, torch.tensor([sample.input_ids]), None, 3, eos_ids=set(),
                     on_logits=lambda t, logits: seen.append(logits.reshape(-1).clone()))
        torch.testing.assert_close(torch.stack(seen), ref, atol=2e-4, rtol=1e-4)


def test_question_split_for_query_agnostic(smollm2_tokenizer):
    """`context_tokens`: turn 0 (and every scdq turn) splits after the context and the template's whitespace (a token
    straddling it belongs to the question); a later multi_turn turn compresses the whole shared history."""
    tok = smollm2_tokenizer
    kv = records("scbench_kv")[0]
    head = "Extract the value corresponding to the specified key in the JSON object below.\n\n" + kv["context"]
    for mode in ("multi_turn", "scdq"):
        samples = SCBench(root=str(FIXTURES), tasks=["scbench_kv"], mode=mode, limit_per_task=1).build(tok, 8000)
        n = samples[0].context_tokens
        assert list(samples[0].input_ids[:n]) == tok.encode(head) and n == len(tok.encode(head))
        later = samples[2]
        assert later.context_tokens == later.meta["prefix_tokens"] == (n if mode == "scdq" else
                                                                        len(samples[1].input_ids))


def test_conversations_append_and_reset_feed_upstreams_texts(smollm2_tokenizer):
    """turn_mode=append is upstream's multi-turn mode with the model's own answers (`--disable_golden_context`): a
    later turn feeds its question alone; reset is the multi-request mode: each query on the compressed context."""
    tok = smollm2_tokenizer
    kv = records("scbench_kv")[0]
    t = kv["multi_turns"]
    append = SCBench(root=str(FIXTURES), tasks=["scbench_kv"], turn_mode="append", limit_per_task=1).build(tok, 8000)
    assert [s.prompt for s in append[1:]] == [t[1]["input"], t[2]["input"]]
    assert append[1].input_ids is None and append[0].meta["conversation"] == append[2].meta["conversation"]
    assert {s.meta["turn_mode"] for s in append} == {"append"} and append[2].meta["followup"] == t[2]["input"]
    # with a chat template: [user <question>] rendered, minus [system ""] rendered without a generation prompt;
    # SmolLM2's default system turn does not contain that string, so upstream's rule leaves it in
    chat = SCBench(root=str(FIXTURES), tasks=["scbench_kv"], turn_mode="append", limit_per_task=1).build(
        tok, 8000, chat_template=True)
    assert chat[1].prompt == SMOL_SYSTEM + "<|im_start|>user\n" + t[1]["input"] + "<|im_end|>\n<|im_start|>assistant\n"
    reset = SCBench(root=str(FIXTURES), tasks=["scbench_kv"], mode="scdq", turn_mode="reset",
                    limit_per_task=1).build(tok, 8000)
    assert [s.meta["question"] for s in reset] == [x["input"] for x in t]
    assert reset[0].context_tokens == len(tok.encode(
        "Extract the value corresponding to the specified key in the JSON object below.\n\n" + kv["context"]))
    assert SCBench(turn_mode="append").turns == 5 and SCBench().turns == 1
    with pytest.raises(ValueError, match="turn_mode=reset runs with mode=scdq"):
        SCBench(turn_mode="reset")
    with pytest.raises(ValueError, match="turn_mode=append runs with mode=multi_turn"):
        SCBench(mode="scdq", turn_mode="append")


def test_cli_conversations_and_agnostic_turns(tmp_path):
    """A conversation per context through the engine (one record per turn, the query fed as upstream tokenizes it),
    and the per-turn samples under query=agnostic (the question fed after compression); with the full cache a
    reset conversation answers each query as the per-turn scdq sample does."""
    from tests.unit.test_cli import records as read_records
    from tests.unit.test_cli import run_here

    common = ["model=tiny_llama", "dataset=scbench", f"dataset.root={FIXTURES}", "dataset.tasks=[scbench_qa_eng]",
              "dataset.limit_per_task=1", "dataset.mode=scdq", "dataset.max_new_tokens=3", "query=agnostic"]
    conv = read_records(run_here(*common, "method=full", "dataset.turn_mode=reset", results=tmp_path / "a"))
    flat = read_records(run_here(*common, "method=full", results=tmp_path / "b"))
    queries = [f"Question: {x['input']}\nAnswer:" for x in records("scbench_qa_eng")[0]["multi_turns"]]
    from transformers import AutoTokenizer

    from kvbench.models.embedded import embedded_model_dir

    tok = AutoTokenizer.from_pretrained(str(embedded_model_dir()))
    assert [r["turn"] for r in conv] == [0, 1, 2] and {r["turn_mode"] for r in conv} == {"reset"}
    assert [r["prompt_tokens"] for r in conv[1:]] == [len(tok.encode(q, add_special_tokens=False)) for q in queries[1:]]
    # every query starts from the same (full) context: its cache holds the context and that query, nothing else
    per_token = conv[0]["kv_bytes"] / flat[0]["prompt_tokens"]
    assert [r["kv_bytes"] for r in conv] == [per_token * r["prompt_tokens"] for r in flat]
    assert [r["prediction"] for r in conv] == [r["prediction"] for r in flat]
    assert [r["question_tokens"] for r in flat] == [len(tok.encode(q, add_special_tokens=False)) for q in queries]
    snap = read_records(run_here(*common, "method=snapkv", "budget=64", "dataset.mode=multi_turn",
                                 "dataset.turn_mode=append", results=tmp_path / "a"))
    assert [r["turn"] for r in snap] == [0, 1, 2] and snap[2]["kv_bytes"] > snap[1]["kv_bytes"] > snap[0]["kv_bytes"]
    from kvbench.report.__main__ import main as report

    assert report([str(tmp_path / "a"), "--out", str(tmp_path / "rep")]) == 0  # conversations kept apart by turn mode
    table = pd.read_csv(tmp_path / "rep" / "query-agnostic" / "scbench_table.csv")  # the report splits by query
    assert sorted(zip(table["turn_mode"], table["method"])) == [("append", "snapkv"), ("reset", "full")]
