"""Conversations decoded together (kvbench.engine.turns.converse_many, `batch_size` > 1) against each conversation
played alone at batch 1 (`converse`, checked against transformers' own greedy decoding in test_turns.py): the same
tokens and cache accounting per turn, whatever order the turns finish in, with turns rejoining the batch while other
conversations decode; a failing turn ends its own conversation only; runs resume per turn at any batch size."""
from __future__ import annotations

import json

import pytest
import torch

import kvbench.methods  # noqa: F401
from kvbench.engine.turns import Conversation, converse, converse_many
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from tests.unit.test_turns import kvbench_run
from tests.unit.tiny import prompt, tiny_model

CONTEXTS = [120, 70, 150, 95]  # prompt lengths: caches differ per conversation
NEW = [6, 2, 9, 4]  # answer lengths: conversations finish turns at different times and rejoin in between
QUESTION = 6
FIELDS = ("token_ids", "text", "prompt_len", "kv_bytes", "full_kv_bytes", "kv_bytes_final", "kept_per_head",
          "kv_bytes_per_layer", "kv_bytes_per_layer_final")


def conversations(mode: str, agnostic: bool, bad_turn: int | None = None) -> list[Conversation]:
    """Four conversations of three turns; `bad_turn`: conversation 1's turn 2 is that token (e.g. one the model's
    vocabulary does not have)."""
    out = []
    for i, (n, new) in enumerate(zip(CONTEXTS, NEW)):
        first = prompt(n, seed=i)[0].tolist() + prompt(QUESTION, seed=50 + i)[0].tolist()
        turns = [prompt(QUESTION + i, seed=10 * i + t)[0].tolist() for t in (1, 2)]
        if i == 1 and bad_turn is not None:
            turns[1] = turns[1][:-1] + [bad_turn]
        out.append(Conversation(first, turns, 40, new, mode=mode, question_len=QUESTION if agnostic else 0,
                                seed=100 + i, tag=i))
    return out


def method_named(name: str):
    return METHODS[name](**({"window": 8} if name == "snapkv" else {}))


def alone(model, name: str, mode: str, agnostic: bool) -> dict:
    """Each conversation by itself, through `converse` at batch size 1."""
    method, out = method_named(name), {}
    with AttentionCapture(model, window=method.query_window) as capture:
        for c in conversations(mode, agnostic):
            for k, gen in enumerate(converse(model, None, method, capture, torch.tensor([c.first_ids]), c.turns,
                                             c.budget, c.max_new_tokens, mode=mode, question_len=c.question_len,
                                             seed=c.seed)):
                out[c.tag, k] = gen
    return out


def together(model, name: str, mode: str, agnostic: bool, batch_size: int = 3, bad_turn: int | None = None):
    """Every conversation through `converse_many`: the outcomes by (conversation, turn), their completion order and
    how many forwards the model ran."""
    method, out, order, forwards = method_named(name), {}, [], []
    handle = model.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        with AttentionCapture(model, window=method.query_window) as capture:
            for c, k, gen in converse_many(model, None, method, capture, conversations(mode, agnostic, bad_turn),
                                           batch_size):
                out[c.tag, k] = gen
                order.append((c.tag, k))
    finally:
        handle.remove()
    return out, order, len(forwards)


@pytest.mark.parametrize("agnostic", [False, True], ids=["aware", "agnostic"])
@pytest.mark.parametrize("mode", ["append", "reset"])
@pytest.mark.parametrize("name", ["h2o", "snapkv"])
def test_conversations_decoded_together_equal_each_conversation_alone(name, mode, agnostic):
    model = tiny_model("llama", layers=2)
    reference = alone(model, name, mode, agnostic)
    _, _, forwards_alone = together(model, name, mode, agnostic, batch_size=1)
    batched, order, forwards = together(model, name, mode, agnostic)
    assert set(batched) == set(reference) and len(reference) == 12
    for key, gen in reference.items():
        for field in FIELDS:
            assert getattr(batched[key], field) == getattr(gen, field), (key, field)
    assert any(gen.token_ids for gen in reference.values())
    assert order != sorted(order)  # turns of different conversations finished in between each other
    for c in range(len(CONTEXTS)):  # and each conversation's turns in turn order
        assert [k for tag, k in order if tag == c] == [0, 1, 2]
    assert forwards < forwards_alone  # decode steps were shared (prefills and feeds are one forward each, alike)


def test_a_failing_turn_ends_its_own_conversation_only():
    """Conversation 1's last turn feeds a token the model has no embedding for: that turn comes back as the error,
    and every other turn is what batch 1 gives."""
    model = tiny_model("llama", layers=2)
    reference = alone(model, "h2o", "append", False)
    batched, order, _ = together(model, "h2o", "append", False, bad_turn=10_000)
    assert isinstance(batched[1, 2], IndexError)
    assert set(batched) == set(reference)
    for key, gen in reference.items():
        if key != (1, 2):
            assert batched[key].token_ids == gen.token_ids and batched[key].kv_bytes == gen.kv_bytes, key


RECORD_FIELDS = ("id", "turn", "turn_mode", "prediction", "new_tokens", "kv_bytes", "full_kv_bytes",
                 "kv_bytes_final", "kept_per_head", "score", "prompt_tokens", "budget")


@pytest.mark.parametrize("method,mode,query,resume", [("snapkv", "append", "agnostic", True),
                                                      ("h2o", "reset", "aware", False)])
def test_niah_multiturn_at_batch_size_3_writes_batch_1_records_and_resumes(tmp_path, method, mode, query, resume):
    overrides = [f"method={method}", f"dataset.turn_mode={mode}", f"query={query}", "dataset.turns=3",
                 "dataset.depth_percents=[20,50,80]", "report=false"]
    _, one = kvbench_run(tmp_path / "b1", *overrides)
    run_dir, many = kvbench_run(tmp_path / "b3", *overrides, "batch_size=3")

    def by_id(records):
        return {r["id"]: {f: r.get(f) for f in RECORD_FIELDS} for r in records}

    assert len(one) == 9 and all("error" not in r for r in one) and by_id(many) == by_id(one)
    if not resume:
        return
    lines = (run_dir / "predictions.jsonl").read_text().splitlines()
    kept = lines[:4]  # a partial run: the last five turns were lost
    (run_dir / "predictions.jsonl").write_text("\n".join(kept) + "\n")
    _, again = kvbench_run(tmp_path / "b3", *overrides, "batch_size=3")
    assert [json.dumps(r) for r in again[:4]] == [json.dumps(json.loads(x)) for x in kept]  # not rewritten
    assert len(again) == 9 and by_id(again) == by_id(one)


def test_conversation_records_fail_only_the_failing_conversations_remaining_turns_and_skip_done_turns():
    """runs/run.py's conversation records at batch_size 3 against batch 1: conversation c1's last turn has a word
    the tiny model has no embedding for, so c1-t2 gets a failure record and every other turn its record; a turn
    already done (c2-t0) is replayed on the cache but not written again."""
    from omegaconf import OmegaConf
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from kvbench.data.base import Sample
    from kvbench.data.niah_multiturn import NeedleMultiTurn
    from kvbench.engine.generation import Sampling
    from kvbench.runs.run import conversation_records

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "ok": 5, "then": 6, "so": 7, "boom": 300}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words)  # (ids up to 300; the model's vocabulary is 256)
    groups = [[Sample(f"c{c}-t{t}", f"c{c}", ["7"], NEW[c], meta={"conversation": f"c{c}", "turn": t,
                                                                    "turn_mode": "append",
                                                                    "followup": "boom ok" if (c, t) == (1, 2) else
                                                                    "ok then so" * (c + 1)},
                      input_ids=tuple(prompt(CONTEXTS[c], seed=c)[0].tolist()) if t == 0 else None)
               for t in range(3)] for c in range(3)]
    model, method = tiny_model("llama", layers=2), method_named("snapkv")

    def records(batch_size: int) -> list[dict]:
        cfg = OmegaConf.create({"query": "aware", "ratio": None, "budget": 40, "batch_size": batch_size,
                                "positions": "original", "seed": 0})
        with AttentionCapture(model, window=method.query_window) as capture:
            return list(conversation_records(model, tokenizer, method, capture, NeedleMultiTurn(), groups, cfg,
                                             None, Sampling(), {"c2-t0"}))

    def by_id(rs):
        return {r["id"]: {f: r.get(f) for f in (*RECORD_FIELDS, "error_type", "failed")} for r in rs}

    one, three = records(1), records(3)
    assert [r["id"] for r in one] == ["c0-t0", "c0-t1", "c0-t2", "c1-t0", "c1-t1", "c1-t2", "c2-t1", "c2-t2"]
    assert [r["id"] for r in one if r.get("failed")] == ["c1-t2"] and one[5]["error_type"] == "IndexError"
    assert by_id(three) == by_id(one) and [r["id"] for r in three] != [r["id"] for r in one]
