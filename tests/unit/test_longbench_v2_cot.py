"""LongBench v2's CoT protocol end to end (THUDM/LongBench @ 2e00731 `pred.py`): the reasoning (first reply) is
followed by a second question with no document and that reply pasted in (`prompts/0shot_cot_ans.txt`), asked as an
independent request (the run's method at its own budget), and the second reply is scored.

On the embedded SmolLM2 (its chat template on, so that it reasons), one fixture question's record is checked against
a recomputation by hand: the second prompt from pred.py's chain of `.replace()`, its reply from a direct `generate`.
On the tiny random model (cheap prefills), a run under query=agnostic is stopped between the two questions of its
second sample, then resumed with a larger `limit` at batch_size=2; the grid launcher then resumes that run and runs
another budget as the basic launcher would."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from kvbench.data.longbench_v2 import COT_ANSWER_TEMPLATE, LongBenchV2
from kvbench.metrics.longbench_v2 import extract_answer
from kvbench.runs.config import CONFIG_DIR
from tests.unit.test_cli import grid_here, refusal, run_here

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "fixtures" / "longbench_v2"
FIRST_NEW, SECOND_NEW, BUDGET = 4, 3, 64
ARGS = ("dataset=longbench_v2", f"dataset.root={DATA}", "dataset.prompt=cot", f"dataset.max_new_tokens={FIRST_NEW}",
        f"dataset.cot_answer_max_new_tokens={SECOND_NEW}", "method=snapkv", f"budget={BUDGET}", "report=false")
EMBEDDED = ("model=smollm2", "model.chat_template=true", *ARGS)
TINY = ("model=tiny_llama", *ARGS, "query=agnostic")  # the second question's own question fed after compression


def lines(run_dir: Path) -> list[str]:
    return (run_dir / "predictions.jsonl").read_text().splitlines()


@pytest.fixture(scope="module")
def cot_run(tmp_path_factory):
    """(run dir, the lines the crashed run left, the sample ids whose second question the resumed run asked)."""
    results = tmp_path_factory.mktemp("results")
    asked: list[str] = []
    ask = LongBenchV2.follow_up

    def crashing(self, sample, *args):  # the second sample's second question: the process is stopped (Ctrl-C)
        asked.append(sample.id)
        if len(asked) == 2:
            raise KeyboardInterrupt
        return ask(self, sample, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LongBenchV2, "follow_up", crashing)
        with pytest.raises(KeyboardInterrupt):
            run_here(*TINY, "limit=2", results=results)
    run_dir = next(results.rglob("predictions.jsonl")).parent
    crashed = lines(run_dir)
    asked.clear()

    def spying(self, sample, *args):
        asked.append(sample.id)
        return ask(self, sample, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LongBenchV2, "follow_up", spying)
        assert run_here(*TINY, "limit=3", "batch_size=2", results=results) == run_dir
    return run_dir, crashed, asked


def test_a_crash_between_the_questions_is_resumed_without_redoing_records(cot_run):
    run_dir, crashed, asked = cot_run
    ids = [f"longbench_v2-66f0a1b2c3d4e5f6a7b8c9d{i}" for i in range(3)]
    assert [json.loads(line)["id"] for line in crashed] == ids[:1]  # the half-asked sample left nothing
    now = lines(run_dir)
    assert now[0] == crashed[0] and len(now) == 3  # kept as written; limit=3 added the third
    assert sorted(asked) == ids[1:]  # only the samples not on disk were asked again (two at once)
    scores = json.loads((run_dir / "scores.json").read_text())
    assert scores["n"] == 3 and scores["longbench_v2"]["n"]["Overall"] == 3
    for r in map(json.loads, now):
        assert {"response_cot", "follow_up"} <= set(r) and r["follow_up"]["new_tokens"] <= SECOND_NEW
        second = r["follow_up"]  # agnostic: the budget is that of what is compressed before "Based on the above..."
        assert second["question_tokens"] > 10 and second["budget"] == BUDGET == r["budget"]
        assert r["scores"]["accuracy"] == float(extract_answer(r["prediction"]) == r["references"][0])


def test_the_second_reply_is_preds_second_question_and_is_scored(tmp_path, monkeypatch, smollm2_tokenizer):
    import kvbench.models
    from kvbench.engine.batching import generate
    from kvbench.models import AttentionCapture

    loaded, load = [], kvbench.models.load
    monkeypatch.setattr(kvbench.models, "load", lambda spec: loaded.append(load(spec)) or loaded[-1])  # kept
    run_dir = run_here(*EMBEDDED, "limit=1", results=tmp_path / "results")
    data = {f"longbench_v2-{r['_id']}": r for r in map(json.loads, (DATA / "data.jsonl").read_text().splitlines())}
    records = [json.loads(line) for line in lines(run_dir)]
    assert len(records) == 1
    for r in records:
        item = data[r["id"]]
        assert r["response_cot"].strip() and r["new_tokens"] <= FIRST_NEW and r["budget"] == BUDGET
        # pred.py: template_0shot_cot_ans.replace('$DOC$', ...)...replace('$COT$', output.strip()), a user turn
        prompt = COT_ANSWER_TEMPLATE.replace("$DOC$", item["context"].strip()).replace("$Q$", item["question"].strip())
        for c in "ABCD":
            prompt = prompt.replace(f"$C_{c}$", item[f"choice_{c}"].strip())
        prompt = prompt.replace("$COT$", r["response_cot"].strip())
        text = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                     add_generation_prompt=True)
        second = r["follow_up"]
        assert second["prompt_sha256"] == hashlib.sha256(text.encode()).hexdigest()
        assert "omitted here" in text and item["context"].strip()[:40] not in text
        ids = smollm2_tokenizer(text, add_special_tokens=False).input_ids
        assert second["prompt_tokens"] == len(ids) > BUDGET == second["budget"]  # compressed like any prompt
        assert second["new_tokens"] <= SECOND_NEW and second["kv_bytes"] < second["full_kv_bytes"]
        assert r["scores"]["accuracy"] == float(extract_answer(r["prediction"]) == item["answer"])
        assert r["scores"]["answered"] == float(extract_answer(r["prediction"]) is not None)
    # the second reply, recomputed: its prompt alone, a fresh SnapKV at the same budget, greedy
    model = loaded[0][0]
    method = instantiate(OmegaConf.load(CONFIG_DIR / "method" / "snapkv.yaml"))
    with AttentionCapture(model, window=method.query_window) as capture, torch.no_grad():
        gen = generate(model, smollm2_tokenizer, method, capture, torch.tensor([ids]), BUDGET, SECOND_NEW)
    assert gen.text == r["prediction"]


def test_the_grid_launcher_runs_it_as_the_basic_launcher_and_beams_are_refused(cot_run, tmp_path):
    run_dir, _, _ = cot_run
    before = lines(run_dir)
    done, fresh = grid_here([[*TINY, "limit=3"], [*TINY, "limit=3", "budget=48"]], results=run_dir.parents[3])
    assert done == run_dir and lines(done) == before  # resumed: nothing to ask again
    records = [json.loads(line) for line in lines(fresh)]
    assert len(records) == 3 and all(r["follow_up"]["budget"] == 48 and r["response_cot"] is not None for r in records)
    line = refusal(*EMBEDDED, "generation.num_beams=2", results=tmp_path / "results")
    assert "num_beams=1" in line and "prompt=cot" in line


def test_follow_up_cuts_and_wraps_the_second_question(smollm2_tokenizer):
    dataset = LongBenchV2(root=str(DATA), prompt="cot", cot_answer_max_new_tokens=5)
    sample = dataset.build(smollm2_tokenizer, 100_000)[1]
    follow = dataset.follow_up(sample, "  The reports agree on 1923.\n", smollm2_tokenizer, 100_000, False)
    assert "The text is too long and omitted here." in follow.prompt and "Report one" not in follow.prompt
    assert "Let’s think step by step: The reports agree on 1923.\n\nBased on the above" in follow.prompt
    assert follow.id == sample.id and follow.answers == sample.answers and follow.max_new_tokens == 5
    assert list(follow.input_ids) == smollm2_tokenizer.encode(follow.prompt) and not follow.meta["truncated"]
    assert follow.prompt[follow.context_end:].startswith("Based on the above, what is the single")
    assert smollm2_tokenizer.decode(follow.input_ids[follow.context_tokens:]).strip().startswith("Based on the above")
    cut = dataset.follow_up(sample, "word " * 200, smollm2_tokenizer, 41, False)  # pred.py's query_llm middle cut
    full = smollm2_tokenizer.encode(follow.prompt.replace("The reports agree on 1923.", ("word " * 200).strip()))
    assert cut.meta["truncated"] and cut.prompt == smollm2_tokenizer.decode(full[:20] + full[-21:],
                                                                            skip_special_tokens=True)
    assert not LongBenchV2(prompt="0shot").asks_follow_up and dataset.asks_follow_up
