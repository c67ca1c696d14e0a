"""The seed-paper datasets on self-written fixtures: byte-exact prompts, selection rules, truncation, scoring
plumbing, per-position / per-protocol summaries, and one-line errors before any weights load."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvbench.data.base import Sample
from kvbench.data.lost_in_the_middle import LostInTheMiddle
from kvbench.data.summarization import CnnDailymail, Xsum, draw_with_replacement
from kvbench.data.wikitext import WikitextPPL

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def test_buzz_prompts_byte_exact(smollm2_tokenizer):
    cnn = CnnDailymail(root=str(FIXTURES / "cnn_dailymail")).build(smollm2_tokenizer)
    article = json.loads((FIXTURES / "cnn_dailymail" / "validation.jsonl").read_text().splitlines()[0])["article"]
    assert cnn[0].prompt == "Text: " + article + "\n\nSUMMARIZE the previous text to 50 words!"
    assert cnn[0].id == "kvb-cnn-001" and cnn[0].max_new_tokens == 1000 and len(cnn) == 3
    assert list(cnn[0].input_ids) == smollm2_tokenizer(cnn[0].prompt).input_ids
    bleu = CnnDailymail(root=str(FIXTURES / "cnn_dailymail"), protocol="buzz_selfbleu").build(smollm2_tokenizer)
    assert bleu[0].prompt == "Text: " + article + "\nSUMMARIZE the previous text to 150 words!"
    xsum = Xsum(root=str(FIXTURES / "xsum"), num_samples=2).build(smollm2_tokenizer)
    assert [s.answers for s in xsum][1] == ["An amateur club scored twice late on to knock the league leaders out "
                                            "of the cup."] and len(xsum) == 2


def test_keyformer_protocol(smollm2_tokenizer, tmp_path):
    long_article = " ".join(f"word{i}" for i in range(3000))
    (tmp_path / "validation.jsonl").write_text("".join(
        json.dumps({"id": f"r{i}", "document": long_article if i == 1 else f"Short text {i}.", "summary": "s"}) + "\n"
        for i in range(5)))
    ds = Xsum(root=str(tmp_path), protocol="keyformer", num_samples=6)
    samples = ds.build(smollm2_tokenizer)
    np.random.seed(12345)  # summarize.py's global seeding, then Dataset's draw
    draws = np.random.randint(5, size=6).tolist()
    assert draws == draw_with_replacement(5, 6, 12345) and len(set(draws)) < 6  # with replacement
    assert [s.id for s in samples] == [f"{k:04d}-r{i}" for k, i in enumerate(draws)]
    k, i = next((k, i) for k, i in enumerate(draws) if i != 1)
    short = samples[k]
    assert short.prompt == ("Below is an instruction that describes a task, paired with an input that provides further "
                            "context. Write a response that appropriately completes the request.\n\n### Instruction:\n"
                            "Provide one sentence summary of the following news article:\n\n### Input:\n"
                            f"Short text {i}.\n\n### Response:")
    long = next(s for s, i in zip(samples, draws) if i == 1)
    full = smollm2_tokenizer(long.prompt).input_ids
    assert len(full) > 1920 and list(long.input_ids) == full[:1920]  # right cut: "### Response:" is lost
    assert ds.primary_metric == "rouge2" and short.max_new_tokens == 128


def test_summarization_scores_and_summary():
    ds = CnnDailymail(root=str(FIXTURES / "cnn_dailymail"))
    s = Sample("a", "p", ["The cat sat on the mat ."], 10)
    scores = ds.score(s, "The cat sat on the mat.")
    assert set(scores) == {"rouge1", "rouge2", "rougeL", "rougeLsum", "buzz_rouge1", "buzz_rouge2", "buzz_rougeL"}
    records = [{"scores": ds.score(s, p)} for p in ("The cat sat on the mat.", "A dog.")]
    out = ds.summarize(records)["summarization"]
    r = out["buzz_rouge"]
    assert r["mean_rouge"] == pytest.approx((r["rouge1"] * r["rouge2"] * r["rougeL"]) ** (1 / 3))
    assert out["keyformer_rouge"]["rouge1"] == round(np.mean([x["scores"]["rouge1"] for x in records]) * 100, 4)


def test_lost_in_the_middle_prompt_positions_and_scores(smollm2_tokenizer):
    ds = LostInTheMiddle(root=str(FIXTURES / "lost_in_the_middle"))
    samples = ds.build(smollm2_tokenizer)
    assert [s.id for s in samples] == [f"gold{p}-{i}" for p in (0, 4, 9) for i in (0, 1)]
    record = json.loads((FIXTURES / "lost_in_the_middle" / "nq-open-10_total_documents_gold_at_4.jsonl")
                        .read_text().splitlines()[0])
    docs = "".join(f"{c['title']}\n{c['text']}\n" for c in record["ctxs"])
    s = samples[2]
    assert s.prompt == (f"Documents are following: {docs}. Based on the provided documents, give an brief answer to "
                        f"this question: {record['question']}. The answer has to directly answer the question and be "
                        "BRIEF. ")
    assert s.meta["gold_in_ctxs"] == 4 and "Ada Marlowe" in s.prompt.split("\n")[9]
    assert ds.score(s, "Marlowe did.\nAda Marlowe") == {"best_subspan_em": 1.0, "exact_match": 0.0}
    assert ds.score(s, "Someone.\nAda Marlowe")["best_subspan_em"] == 0.0  # first line only
    records = [{"meta": x.meta, "scores": {"best_subspan_em": float(x.meta["gold_position"] == 0 or i % 2)}}
               for i, x in enumerate(samples)]
    out = ds.summarize(records)["lost_in_the_middle"]
    assert out["best_subspan_em"] == {"gold_at_0": 100.0, "gold_at_4": 50.0, "gold_at_9": 50.0}
    assert out["avg"] == pytest.approx(200 / 3)


def test_wikitext_stream_and_chunked_records(smollm2_tokenizer):
    rows = [json.loads(line)["text"] for line in (FIXTURES / "wikitext_ppl" / "validation.jsonl").read_text().splitlines()]
    one = WikitextPPL(root=str(FIXTURES / "wikitext_ppl"), num_rows=6).build(smollm2_tokenizer)
    assert len(one) == 1 and one[0].id == "rows0-5"
    assert one[0].meta["row_lengths"] == [len(smollm2_tokenizer(r).input_ids) for r in rows[:6]]
    split = WikitextPPL(root=str(FIXTURES / "wikitext_ppl"), rows_per_record=3).build(smollm2_tokenizer)
    assert [s.id for s in split] == ["rows0-2", "rows3-5", "rows6-7"]
    chunked = WikitextPPL(root=str(FIXTURES / "wikitext_ppl"), mode="chunked", window=32, context=20)
    windows = chunked.build(smollm2_tokenizer)
    ids = smollm2_tokenizer("\n\n".join(rows)).input_ids
    assert [list(w.input_ids) for w in windows] == [ids[i:i + 32] for i in range(0, len(ids), 32)
                                                    if len(ids[i:i + 32]) > 20]
    assert chunked.primary_metric == "ppl_chunked"
    out = chunked.summarize([{"nll_sum": 2.0, "n_tokens": 4}, {"nll_sum": 4.0, "n_tokens": 2}])["perplexity"]
    assert out["ppl"] == pytest.approx(np.exp(1.0))


@pytest.mark.parametrize("make,message", [
    (lambda: CnnDailymail(root="/nonexistent"), "cnn_dailymail: no validation.jsonl in /nonexistent/"),
    (lambda: LostInTheMiddle(root="/nonexistent"), "lost_in_the_middle: /nonexistent/ lacks nq-open-10"),
    (lambda: WikitextPPL(root="/nonexistent"), "wikitext_ppl: no validation.jsonl in /nonexistent/"),
])
def test_missing_data_is_one_line(make, message):
    with pytest.raises(FileNotFoundError) as e:
        make().check()
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize("make,message", [
    (lambda: Xsum(protocol="buzz_selfbleu"), "xsum: protocol buzz_selfbleu"),
    (lambda: CnnDailymail(protocol="keyfromer"), "cnn_dailymail: Unknown protocol 'keyfromer'. Did you mean: keyformer?"),
    (lambda: LostInTheMiddle(gold_positions=[10]), "lost_in_the_middle: gold_positions=[10]"),
    (lambda: WikitextPPL(mode="chunk"), "wikitext_ppl: mode='chunk' is not one of stream, chunked"),
])
def test_bad_config_is_one_line(make, message):
    with pytest.raises(ValueError) as e:
        make()
    assert str(e.value).startswith(message)
