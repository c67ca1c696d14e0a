"""Several questions over one compressed context (kvbench.engine.turns, dataset=niah_multiturn).

With the full cache a conversation must equal plain greedy decoding of the text it amounts to: in `append` mode the
whole conversation so far (prompt, answer, follow-up, ...), in `reset` mode the context followed by that turn's
question alone. That is checked against transformers' own `generate`, independent of kvbench's cache and engine."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

import kvbench.methods  # noqa: F401
from kvbench.engine.turns import Limits, converse
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from kvbench.runs.config import CONFIG_DIR, setup
from kvbench.runs.run import run
from tests.unit.tiny import prompt, tiny_model

NEW = 5


def greedy(model, ids: list[int], new: int = NEW) -> list[int]:
    """transformers' greedy continuation, cut before EOS as kvbench cuts it."""
    eos = model.generation_config.eos_token_id
    out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, pad_token_id=eos)[0, len(ids):]
    out = out.tolist()
    return out[: out.index(eos)] if eos in out else out


def test_append_with_the_full_cache_is_greedy_decoding_of_the_whole_conversation():
    model = tiny_model("llama")
    first, followups = prompt(90)[0].tolist(), [prompt(7, seed=s)[0].tolist() for s in (3, 4)]
    with AttentionCapture(model) as capture:
        gens = list(converse(model, None, METHODS["full"](), capture, torch.tensor([first]), followups, None, NEW))
    conversation = list(first)
    for gen, followup in zip(gens, [None, *followups]):
        conversation += followup or []
        assert gen.token_ids == greedy(model, conversation) and gen.token_ids
        conversation += gen.token_ids
    assert gens[2].kv_bytes > gens[1].kv_bytes > gens[0].kv_bytes  # one cache, growing with the conversation
    assert [g.kv_bytes for g in gens] == [g.full_kv_bytes for g in gens]  # the full cache is 100 % of itself


def test_each_turn_ends_by_its_own_limits():
    """A dataset's turns may ask for different answer lengths and stop tokens: turn k decodes by its own sample's
    limits, not the first turn's (greedy decoding of the whole conversation, as above, is the reference)."""
    model = tiny_model("llama")
    first, followups = prompt(90)[0].tolist(), [prompt(7, seed=s)[0].tolist() for s in (3, 4)]
    before_last = first + greedy(model, first, 2) + followups[0]
    before_last += greedy(model, before_last, 7) + followups[1]
    last = greedy(model, before_last, 6)
    stop = last[2]  # the last turn stops at this token (excluded), before its length
    per_turn = [Limits(2), Limits(7), Limits(6, stop_token_ids=(stop,))]
    with AttentionCapture(model) as capture:
        gens = list(converse(model, None, METHODS["full"](), capture, torch.tensor([first]), followups, None, NEW,
                             per_turn=per_turn))
    conversation = list(first)
    for gen, followup, limits in zip(gens, [None, *followups], per_turn):
        conversation += followup or []
        expected = greedy(model, conversation, limits.max_new_tokens)
        if limits.stop_token_ids:
            expected = expected[:expected.index(stop)]
        assert gen.token_ids == expected
        conversation += expected
    assert [len(g.token_ids) for g in gens] == [2, 7, last.index(stop)]


def test_reset_agnostic_with_the_full_cache_answers_each_question_after_the_context_alone():
    model = tiny_model("qwen2")
    context, questions = prompt(90)[0].tolist(), [prompt(6, seed=s)[0].tolist() for s in (5, 6, 7)]
    with AttentionCapture(model) as capture:
        gens = list(converse(model, None, METHODS["full"](), capture, torch.tensor([context + questions[0]]),
                             questions[1:], None, NEW, mode="reset", question_len=6))
    assert [g.token_ids for g in gens] == [greedy(model, context + q) for q in questions]
    assert len({g.kv_bytes for g in gens}) == 1  # every turn starts from the same cache
    assert [g.kv_bytes for g in gens] == [g.full_kv_bytes for g in gens]  # context + question, as a full cache holds


@pytest.mark.parametrize("name", ["snapkv", "h2o"])
def test_reset_restores_the_compressed_context_and_the_methods_state(name):
    """Asking turn 0's question again in reset mode must give turn 0's answer token for token (H2O's accumulated
    scores and evictions are copied and restored with the cache)."""
    model = tiny_model("llama")
    method = METHODS[name](**({"window": 8} if name == "snapkv" else {}))
    context, question = prompt(120)[0].tolist(), prompt(6, seed=8)[0].tolist()
    with AttentionCapture(model, window=method.query_window) as capture:
        gens = list(converse(model, None, method, capture, torch.tensor([context + question]), [question, question],
                             40, NEW, mode="reset", question_len=6))
    assert gens[0].token_ids == gens[1].token_ids == gens[2].token_ids and gens[0].kv_bytes < gens[0].full_kv_bytes


def kvbench_run(tmp_path: Path, *overrides: str) -> tuple[Path, list[dict]]:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["model=tiny_llama", "dataset=niah_multiturn", "method=snapkv", "budget=64",
                                           "dataset.context_lengths=[400]", "dataset.depth_percents=[20,70]",
                                           "dataset.max_new_tokens=3", f"results_dir={tmp_path}", *overrides],
                      return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    run_dir = Path(cfg.hydra.run.dir)
    with open_dict(cfg):
        del cfg["hydra"]
    run(cfg, run_dir, setup(cfg))
    return run_dir, [json.loads(x) for x in (run_dir / "predictions.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("mode", ["append", "reset"])
def test_niah_multiturn_writes_a_record_per_turn_resumes_per_turn_and_draws_turns_by_depth(tmp_path, mode):
    run_dir, records = kvbench_run(tmp_path, f"dataset.turn_mode={mode}", "dataset.turns=2", "query=agnostic")
    ids = [f"niahmt-L400-r{r}-t{t}" for r in (0, 1) for t in (0, 1)]
    assert [r["id"] for r in records] == ids and [r["turn"] for r in records] == [0, 1, 0, 1]
    assert all("error" not in r and r["turn_mode"] == mode and r["query"] == "agnostic" for r in records)
    # rotation r asks the needle at depth index (t + r) mod 2 at turn t
    assert [r["meta"]["depth_percent"] for r in records] == [20.0, 70.0, 70.0, 20.0]
    if mode == "append":  # the answer and the follow-up join the cache
        assert records[1]["kv_bytes"] > records[0]["kv_bytes"]
    else:  # each turn starts again from the compressed context, then its own question
        assert records[1]["kv_bytes"] == records[0]["kv_bytes"]
    scores = json.loads((run_dir / "scores.json").read_text())
    assert scores["n"] == 4 and set(scores["niah_multiturn"]) >= {"turn0", "turn1", "turn1-d20"}
    assert (run_dir / "turns.png").is_file() and json.loads((run_dir / "manifest.json").read_text())["query"] == "agnostic"
    lines = (run_dir / "predictions.jsonl").read_text().splitlines()
    (run_dir / "predictions.jsonl").write_text("\n".join(lines[:-1]) + "\n")  # the last turn was lost
    _, again = kvbench_run(tmp_path, f"dataset.turn_mode={mode}", "dataset.turns=2", "query=agnostic")
    assert [r["id"] for r in again] == ids and again[-1]["prediction"] == records[-1]["prediction"]


def test_report_keeps_append_and_reset_conversations_apart(tmp_path):
    from kvbench.report import load_runs, summary_table

    for mode in ("append", "reset"):
        kvbench_run(tmp_path, f"dataset.turn_mode={mode}", "dataset.context_lengths=[350]",
                    "dataset.depth_percents=[50]", "dataset.turns=1")
    table = summary_table(load_runs([tmp_path]))
    assert list(table["turn_mode"]) == ["append", "reset"] and list(table["n"]) == [1, 1]
