"""LongBench builder on the self-written fixtures (tests/fixtures/longbench): constants, exact prompts and token
counts, middle truncation, the chat-template rule, stops, scoring plumbing, aggregation, configs, errors, download.

Token counts are SmolLM2's (the embedded tokenizer, which adds no BOS); `WordTokenizer` below adds one, to pin the
"BOS counts" parts of pred.py's truncation.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from dataclasses import fields
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kvbench.data.base import Sample
from kvbench.data.longbench import PROTOCOLS, LongBench, middle_truncate, read_records, summarize_longbench
from kvbench.data.longbench_prompts import (ALL21, CHAT_SKIP, DATASET2MAXLEN, DATASET2PROMPT, E13, FIRST_LINE_TASKS,
                                            GROUPS, KV16, TASKS)
from kvbench.registry import DATASETS

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "longbench"
TREC_1 = ("Please determine the type of the question below. Here are some examples of questions.\n\n"
          "Question: What city hosts the Blue Finch Press ?\nType: City\nQuestion: Who founded the press ?\n"
          "Type: Individual\nQuestion: What country borders the river Ostra ?\nType: Country\n"
          "Question: Where is the Gull Rock lighthouse ?\nType:")
LCC_1 = ("Please complete the code given below. \ndef area(width, height):\n    \"\"\"Area of a rectangle.\"\"\"\n"
         "    return width * height\n\n\ndef perimeter(width, height):\nNext line of code:\n")


def build(tokenizer, tasks, max_tokens=8000, chat=False, **kw) -> dict[str, Sample]:
    ds = LongBench(root=str(FIXTURES), tasks=tasks, **kw)
    return {s.id: s for s in ds.build(tokenizer, max_tokens, chat_template=chat)}


# --- constants ------------------------------------------------------------------------------------------------------
def test_constants_are_upstream_files_byte_for_byte():
    """sha256 of THUDM/LongBench@2e00731 LongBench/config/dataset2prompt.json and dataset2maxlen.json."""
    def sha(obj) -> str:
        return hashlib.sha256(json.dumps(obj, indent=4, ensure_ascii=False).encode()).hexdigest()

    assert sha(DATASET2PROMPT) == "56d22ad4f382169c2b8a11ff4c982a4a1bea096c8152b0f0b85b64686b157c30"
    assert sha(DATASET2MAXLEN) == "72966b3c0933e214591637fb085798c5e687ebff4ddaab5d99bbc31120532022"
    assert DATASET2PROMPT["narrativeqa"].count("asconcisely") == 2
    assert "\n\n Answer the question based on the above article" in DATASET2PROMPT["qasper"]
    assert DATASET2PROMPT["passage_count"].endswith("The final answer is: ")
    assert DATASET2PROMPT["lcc"] == "Please complete the code given below. \n{context}Next line of code:\n"


def test_task_table_and_groups():
    assert list(TASKS) == list(DATASET2PROMPT) == list(DATASET2MAXLEN) == list(ALL21)
    assert len(KV16) == 16 and set(ALL21) - set(KV16) == {"multifieldqa_zh", "dureader", "vcsum", "lsht",
                                                          "passage_retrieval_zh"}
    assert [TASKS[t].label for t in KV16] == ["NrtvQA", "Qasper", "MF-en", "HotpotQA", "2WikiMQA", "Musique",
                                              "GovReport", "QMSum", "MultiNews", "TREC", "TriviaQA", "SAMSum",
                                              "PCount", "PRe", "Lcc", "RB-P"]
    assert len(E13) == 13 and set(CHAT_SKIP) == {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}
    assert set(FIRST_LINE_TASKS) == {"trec", "triviaqa", "samsum", "lsht"}
    assert DATASETS["longbench"] is LongBench


# --- configs --------------------------------------------------------------------------------------------------------
def test_generated_configs_are_up_to_date():
    out = subprocess.run([sys.executable, "scripts/gen_longbench_configs.py", "--check"], cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("group", list(GROUPS))
def test_config_mirrors_the_dataclass_and_names_its_group(group):
    cfg = OmegaConf.load(REPO / "configs" / "dataset" / f"{group}.yaml")
    assert set(cfg) - {"_target_"} == {f.name for f in fields(LongBench) if f.init}
    assert list(cfg.tasks) == list(GROUPS[group]) and cfg.version == LongBench.version
    ds = LongBench(**{k: v for k, v in OmegaConf.to_container(cfg).items() if k != "_target_"})
    assert ds.tasks == list(GROUPS[group])


# --- prompts, token counts, truncation ----------------------------------------------------------------------------
def test_exact_prompts_and_token_counts(smollm2_tokenizer):
    samples = build(smollm2_tokenizer, ["trec", "lcc", "qasper", "passage_count"])
    assert samples["trec-kvb-trc-001"].prompt == TREC_1
    assert samples["lcc-kvb-lcc-001"].prompt == LCC_1
    counts = {sid: len(s.input_ids) for sid, s in samples.items()}
    assert counts == {"trec-kvb-trc-001": 74, "trec-kvb-trc-002": 58, "lcc-kvb-lcc-001": 44, "lcc-kvb-lcc-002": 34,
                      "qasper-kvb-qas-001": 211, "qasper-kvb-qas-002": 601, "passage_count-kvb-pco-001": 154}
    for s in samples.values():
        assert list(s.input_ids) == smollm2_tokenizer(s.prompt).input_ids
        assert not s.meta["truncated"] and not s.meta["chat"]


@pytest.mark.parametrize("max_tokens", [300, 301])   # int(max / 2) = 150 both times
def test_middle_truncation_keeps_both_ends(smollm2_tokenizer, max_tokens):
    q = build(smollm2_tokenizer, ["qasper"], max_tokens=max_tokens)["qasper-kvb-qas-002"]
    assert q.meta["truncated"] and len(q.input_ids) == 300
    # 150 tokens end inside section 2, the last 150 start inside section 11; the texts are joined as they are
    assert ("after 20 epochs of on noisy sensor logs collected from 13 greenhouses, and we report accuracy after "
            "110 epochs of training. Section 12.") in q.prompt
    assert q.prompt.startswith("You are given a scientific article and a question.")
    assert q.prompt.endswith("Do not provide any explanation.\n\nQuestion: Is the tagger recurrent?\n\nAnswer:")
    untouched = build(smollm2_tokenizer, ["qasper"], max_tokens=601)["qasper-kvb-qas-002"]
    assert not untouched.meta["truncated"] and len(untouched.input_ids) == 601


class WordTokenizer:
    """One id per whitespace word, BOS (id 1) added by default, `<s>` skipped when decoding; a stand-in that makes
    pred.py's special-token handling visible."""

    bos = "<s>"

    def __init__(self):
        self.vocab: dict[str, int] = {self.bos: 1}

    def _id(self, w: str) -> int:
        return self.vocab.setdefault(w, len(self.vocab) + 1)

    def __call__(self, text: str, add_special_tokens: bool = True, truncation: bool = False):
        ids = [self._id(w) for w in text.split()]

        class Out:
            input_ids = ([1] if add_special_tokens else []) + ids
        return Out()

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        words = {v: k for k, v in self.vocab.items()}
        return " ".join(words[i] for i in ids if not (skip_special_tokens and i == 1))

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return f"<s> USER: {messages[0]['content']} ASSISTANT:"


def test_truncation_counts_the_bos_and_skips_it_when_decoding():
    tok = WordTokenizer()
    prompt = " ".join(f"w{i}" for i in range(10))           # 10 words + BOS = 11 tokens
    assert middle_truncate(tok, prompt, 11) == (prompt, False)
    text, cut = middle_truncate(tok, prompt, 10)              # half = 5: BOS w0..w3 | w5..w9
    assert cut and text == "w0 w1 w2 w3" + "w5 w6 w7 w8 w9"   # joined with no separator, BOS dropped
    assert middle_truncate(tok, prompt, 9)[0] == "w0 w1 w2" + "w6 w7 w8 w9"      # int(9 / 2) = 4: BOS w0 w1 w2


def test_chat_rule_follows_the_skip_list_and_the_protocol(tmp_path):
    tok = WordTokenizer()
    official = build(tok, ["qasper", "trec", "lcc"], chat=True)
    assert official["qasper-kvb-qas-001"].prompt.startswith("<s> USER: You are given")
    assert official["qasper-kvb-qas-001"].input_ids[:2] != (1, 1)      # template's BOS only, none added on top
    assert official["qasper-kvb-qas-001"].meta["chat"] is True
    assert official["trec-kvb-trc-001"].prompt == TREC_1 and not official["trec-kvb-trc-001"].meta["chat"]
    assert official["trec-kvb-trc-001"].input_ids[0] == 1             # default special tokens: BOS added
    paper = build(tok, ["trec"], chat=True, protocol="pyramidkv_paper")
    assert paper["trec-kvb-trc-001"].prompt.startswith("<s> USER: Please determine")
    llama2 = build(tok, ["qasper", "lcc"], chat=True, chat_format="[INST]{prompt}[/INST]")
    assert llama2["qasper-kvb-qas-001"].prompt.startswith("[INST]You are given")
    assert llama2["qasper-kvb-qas-001"].prompt.endswith("Answer:[/INST]")
    assert llama2["qasper-kvb-qas-001"].input_ids[0] == 1
    assert llama2["lcc-kvb-lcc-001"].prompt == LCC_1
    off = build(tok, ["qasper"], chat=False, chat_format="[INST]{prompt}[/INST]")
    assert not off["qasper-kvb-qas-001"].prompt.startswith("[INST]")


def test_chat_template_with_the_real_tokenizer(smollm2_tokenizer):
    s = build(smollm2_tokenizer, ["qasper", "samsum"], chat=True)
    q = s["qasper-kvb-qas-001"]
    assert q.prompt.startswith("<|im_start|>system\n")
    assert q.prompt.endswith("Answer:<|im_end|>\n<|im_start|>assistant\n")
    assert list(q.input_ids) == smollm2_tokenizer(q.prompt, add_special_tokens=False).input_ids
    assert not s["samsum-kvb-sam-001"].prompt.startswith("<|im_start|>")


def test_sample_fields(smollm2_tokenizer):
    samples = build(smollm2_tokenizer, ["samsum", "trec", "lsht", "qasper_e", "gov_report"], limit_per_task=1)
    assert list(samples) == ["samsum-kvb-sam-001", "trec-kvb-trc-001", "lsht-kvb-lsh-001", "qasper_e-kvb-qae-001",
                             "gov_report-kvb-gov-001"]
    sam, trec, lsht, qe, gov = samples.values()
    newline = smollm2_tokenizer.encode("\n", add_special_tokens=False)[-1]
    assert (sam.max_new_tokens, sam.stop_token_ids, sam.min_new_tokens) == (128, (newline,), 1)  # pred.py
    assert (trec.max_new_tokens, trec.stop_token_ids, trec.min_new_tokens) == (64, (), 0)
    assert gov.max_new_tokens == 512
    assert trec.meta["all_classes"] == ["Location", "Other location", "City", "Country", "Individual"]
    assert lsht.answers == ["体育"] and "all_classes" not in sam.meta
    assert qe.meta == {"task": "qasper_e", "index": 0, "length": 1200, "truncated": False, "chat": False}
    assert qe.max_new_tokens == 128 and qe.prompt.startswith("You are given a scientific article")
    paper = build(smollm2_tokenizer, ["samsum"], protocol="pyramidkv_paper", limit_per_task=1)
    assert paper["samsum-kvb-sam-001"].stop_token_ids == () and paper["samsum-kvb-sam-001"].min_new_tokens == 1


def test_every_fixture_file_builds(smollm2_tokenizer):
    stems = sorted(p.stem for p in FIXTURES.glob("*.jsonl"))
    samples = build(smollm2_tokenizer, stems)
    assert len(samples) == sum(len(read_records(FIXTURES / f"{s}.jsonl")) for s in stems) == 30


# --- scoring plumbing and aggregation ------------------------------------------------------------------------------
def test_score_applies_the_first_line_rule_only_where_upstream_does():
    ds = LongBench(tasks=["triviaqa", "narrativeqa"])
    trivia = Sample("t", "", ["mast"], 32, meta={"task": "triviaqa"})
    story = Sample("n", "", ["Tomas"], 128, meta={"task": "narrativeqa"})
    assert ds.score(trivia, "\n\nmast\nQuestion: what") == {"longbench": 1.0}
    assert ds.score(story, "Tomas\nTomas") == {"longbench": pytest.approx(2 / 3)}


def test_code_sim_backend_is_a_switch():
    lcc = Sample("c", "", ["    total += values[i];"], 64, meta={"task": "lcc"})
    pred = "    return self.cache[key]"          # a golden pair on which the two backends differ
    assert LongBench(tasks=["lcc"]).score(lcc, pred)["longbench"] == 0.33
    assert LongBench(tasks=["lcc"], code_sim_backend="levenshtein").score(lcc, pred)["longbench"] == 0.41


def rec(task: str, score: float, index: int = 0, length: int = 0) -> dict:
    return {"score": score, "meta": {"task": task, "index": index, "length": length}}


def test_summarize_tasks_avg_categories():
    records = [rec("qasper", 1.0, 0), rec("qasper", 0.0, 1), rec("trec", 1 / 3), rec("lcc", 0.5),
               rec("multifieldqa_zh", 0.25)]
    out = summarize_longbench(records, order=["trec", "qasper", "lcc", "multifieldqa_zh"])
    assert out["tasks"] == {"trec": 33.33, "qasper": 50.0, "lcc": 50.0, "multifieldqa_zh": 25.0}
    assert out["n"] == {"trec": 1, "qasper": 2, "lcc": 1, "multifieldqa_zh": 1}
    assert out["avg"] == round((33.33 + 50 + 50 + 25) / 4, 2)
    assert out["categories"]["en"] == {"Single-Doc. QA": 50.0, "Few-shot Learning": 33.33, "Code": 50.0,
                                       "Avg": round((50 + 33.33 + 50) / 3, 2)}
    assert out["categories"]["zh"] == {"Single-Doc. QA": 25.0, "Code": 50.0, "Avg": 37.5}
    assert "e_buckets" not in out
    # qasper 1 and 0: se = 50 (x100); the single-sample tasks have none, so no average has one
    assert out["tasks_se"] == {"trec": None, "qasper": 50.0, "lcc": None, "multifieldqa_zh": None}
    assert out["avg_se"] is None and out["categories_se"]["en"]["Single-Doc. QA"] == 50.0


def test_summarize_longbench_se_of_averages_by_hand():
    records = [rec("qasper", s, i) for i, s in enumerate([1.0, 0.0])] + \
              [rec("trec", s, i) for i, s in enumerate([1.0, 1.0, 0.0, 0.0])] + \
              [rec("samsum", s, i) for i, s in enumerate([0.5, 0.3])]
    out = summarize_longbench(records)
    # per task se x100: qasper 50, trec sqrt(1/3)/2 = 28.8675, samsum 0.1414/sqrt(2) = 10
    assert out["tasks_se"] == {"qasper": 50.0, "samsum": 10.0, "trec": 28.8675}
    trec_var = 10000 / 12                     # (100 * sqrt(1/3) / 2)^2
    assert out["avg_se"] == pytest.approx((2500 + trec_var + 100) ** 0.5 / 3, abs=1e-4)   # not (50+28.9+10)/3
    # en categories: Single-Doc. QA = qasper, Few-shot = trec and samsum; Avg = mean of the two category means
    assert out["categories_se"]["en"]["Few-shot Learning"] == pytest.approx((trec_var + 100) ** 0.5 / 2, abs=1e-4)
    assert out["categories_se"]["en"]["Avg"] == pytest.approx((2500 / 4 + trec_var / 16 + 100 / 16) ** 0.5, abs=1e-4)


def test_summarize_longbench_e_buckets():
    records = [rec("qasper_e", 1.0, 0, 1200), rec("qasper_e", 0.5, 1, 5200), rec("qasper_e", 0.0, 2, 9100),
               rec("trec_e", 1.0, 0, 3999), rec("trec_e", 0.0, 1, 4000)]
    out = summarize_longbench(records)
    assert out["e_buckets"] == {"qasper_e": {"0-4k": 100.0, "4-8k": 50.0, "8k+": 0.0},
                                "trec_e": {"0-4k": 100.0, "4-8k": 0.0, "8k+": None}}
    assert out["e_avg"] == {"0-4k": 100.0, "4-8k": 25.0, "8k+": 0.0}
    # one sample per (task, bucket) except nowhere: no se anywhere; with two in a bucket, sd / sqrt(2)
    assert out["e_buckets_se"]["qasper_e"] == {"0-4k": None, "4-8k": None, "8k+": None}
    two = summarize_longbench([rec("trec_e", 1.0, 0, 100), rec("trec_e", 0.0, 1, 200)])
    assert two["e_buckets_se"]["trec_e"]["0-4k"] == 50.0 and two["e_avg_se"]["0-4k"] == 50.0
    assert two["e_avg_se"]["8k+"] is None


def test_dataset_summarize_records_the_protocol():
    out = LongBench(tasks=["samsum"]).summarize([rec("samsum", 0.5)])["longbench"]
    assert out["protocol"] == "longbench" and out["newline_stop"] == ["samsum"]
    assert out["chat_skip"] == list(PROTOCOLS["longbench"].chat_skip) and out["code_sim_backend"] == "difflib"
    assert out["tasks"] == {"samsum": 50.0}


# --- errors ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    ({"tasks": []}, "tasks is empty"),
    ({"tasks": ["qasperr"]}, "Did you mean: qasper"),
    ({"tasks": ["trec", "trec"]}, "more than once"),
    ({"protocol": "kvpress"}, "Unknown protocol 'kvpress'"),
    ({"limit_per_task": 0}, "limit_per_task=0"),
    ({"chat_format": "[INST]"}, "must contain {prompt}"),
    ({"code_sim_backend": "rapidfuzz"}, "code_sim_backend='rapidfuzz'"),
])
def test_bad_config_fails_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LongBench(**kwargs)


def test_missing_folder_and_file_name_the_downloader(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no folder .*scripts/download_longbench.py") as e:
        LongBench(root=str(tmp_path / "nope")).check()
    assert "\n" not in str(e.value)
    with pytest.raises(FileNotFoundError, match=r"lacks musique.jsonl, qmsum.jsonl; run `python scripts/"):
        LongBench(root=str(FIXTURES), tasks=["musique", "qasper", "qmsum"]).check()


@pytest.mark.parametrize("line, match", [
    ('{"input": "q", "context": "c"', "not valid JSON"),
    ('["a list"]', "expected a JSON object"),
    ('{"input": "q", "context": "c", "answers": ["a"], "length": 3}', "field '_id' must be a str"),
    ('{"input": "q", "context": "c", "answers": "a", "length": 3, "_id": "x"}', "field 'answers' must be a list"),
    ('{"input": "q", "context": "c", "answers": [], "length": 3, "_id": "x"}', "non-empty list of strings"),
    ('{"input": "q", "context": "c", "answers": ["a"], "length": "3", "_id": "x"}', "field 'length' must be a int"),
])
def test_malformed_record_names_file_and_line(tmp_path, line, match):
    good = json.dumps({"input": "q", "context": "c", "answers": ["a"], "length": 1, "_id": "ok", "all_classes": None})
    (tmp_path / "qasper.jsonl").write_text(good + "\n\n" + line + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=match) as e:
        LongBench(root=str(tmp_path), tasks=["qasper"]).read_task("qasper")
    assert f"{tmp_path / 'qasper.jsonl'}:3:" in str(e.value) and "\n" not in str(e.value)


def test_duplicate_ids_are_rejected(tmp_path):
    line = json.dumps({"input": "q", "context": "c", "answers": ["a"], "length": 1, "_id": "same"})
    (tmp_path / "trec.jsonl").write_text(line + "\n" + line + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"trec.jsonl:2: _id 'same' repeats line 1"):
        LongBench(root=str(tmp_path), tasks=["trec"]).read_task("trec")


# --- downloader -----------------------------------------------------------------------------------------------------
def test_downloader_unpacks_a_local_zip(tmp_path):
    archive = tmp_path / "data.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for name in ("trec.jsonl", "lcc_e.jsonl"):
            zf.write(FIXTURES / name, f"data/{name}")
    out = subprocess.run([sys.executable, "scripts/download_longbench.py", "--zip", str(archive), "--root",
                          str(tmp_path / "lb")], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "lb" / "trec.jsonl").read_bytes() == (FIXTURES / "trec.jsonl").read_bytes()
    source = json.loads((tmp_path / "lb" / "SOURCE.json").read_text())
    assert source["files"]["trec"]["records"] == 2 and len(source["zip_sha256"]) == 64
    assert "trec.jsonl has 2 records, LongBench lists 200" in out.stderr
    again = subprocess.run([sys.executable, "scripts/download_longbench.py", "--zip", str(archive), "--root",
                            str(tmp_path / "lb")], cwd=REPO, capture_output=True, text=True)
    assert again.returncode == 1 and "pass --force" in again.stderr


def test_downloader_explains_what_to_do_offline(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    out = subprocess.run([sys.executable, "scripts/download_longbench.py", "--root", str(tmp_path / "lb")], cwd=REPO,
                         capture_output=True, text=True, env=env)
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("download_longbench: cannot fetch THUDM/LongBench data.zip") and "--zip" in last


def test_max_new_tokens_caps_every_task_budget(smollm2_tokenizer):
    """Smoke runs cap generation; null keeps pred.py's per-task lengths."""
    from kvbench.data.longbench import LongBench

    fixtures = Path(__file__).resolve().parents[1] / "fixtures" / "longbench"
    own = LongBench(root=str(fixtures), tasks=["hotpotqa", "gov_report"], limit_per_task=1).build(smollm2_tokenizer, 8000)
    capped = LongBench(root=str(fixtures), tasks=["hotpotqa", "gov_report"], limit_per_task=1, max_new_tokens=8).build(
        smollm2_tokenizer, 8000)
    assert [s.max_new_tokens for s in own] == [32, 512] and [s.max_new_tokens for s in capped] == [8, 8]
    with pytest.raises(ValueError, match="max_new_tokens"):
        LongBench(max_new_tokens=0)
