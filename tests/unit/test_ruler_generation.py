"""RULER generation: byte-for-byte equality with the upstream generator (tests/fixtures/ruler, made by running
NVIDIA/RULER c5341b4 itself), determinism, length targeting, the sample cache and the offline sources."""
from __future__ import annotations

import hashlib
import json
import logging
import random
from pathlib import Path

import pytest

from kvbench.data.ruler import Ruler, generate_task, sources
from kvbench.data.ruler.length import fit, linear_search, token_counter, tokenizer_fingerprint
from kvbench.data.ruler.templates import ALL_TASKS, tokens_to_generate
from kvbench.metrics.sentences import sentence_splitter

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "ruler"
QA = {"qa_1": FIXTURES / "qa" / "dev-v2.0.json", "qa_2": FIXTURES / "qa" / "hotpot_dev_distractor_v1.json"}
GOLDEN = sorted(FIXTURES.glob("*/*/*.jsonl"))


class Whitespace:
    """The stand-in tokenizer the fixtures were made with: tokens are `text.split()`."""
    fingerprint = "whitespace"

    def tokenize(self, text: str) -> list[str]:
        return text.split()


def golden_id(path: Path) -> str:
    return "/".join(path.parts[-3:])


@pytest.mark.parametrize("path", GOLDEN, ids=golden_id)
def test_matches_upstream_byte_for_byte(path, smollm2_tokenizer):
    folder, length, task = path.parts[-3], int(path.parts[-2]), path.stem
    tok_type, _, template = folder.partition("-")
    tokenizer = Whitespace() if tok_type == "ws" else smollm2_tokenizer
    expected = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    got = generate_task(task, token_counter(tokenizer), length, len(expected), model_template=template or "base",
                        qa_path=QA.get(task))
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        if "input" in e:
            assert g["input"] == e["input"]
        assert hashlib.sha256(g["input"].encode("utf-8")).hexdigest() == e["input_sha256"]
        assert (g["index"], g["outputs"], g["length"]) == (e["index"], e["outputs"], e["length"])


def test_fixtures_cover_every_task():
    assert {p.stem for p in GOLDEN} == set(ALL_TASKS)
    assert {p.parts[-3] for p in GOLDEN} >= {"ws", "hf", "ws-meta-chat"}


def small(**kw) -> Ruler:
    args = dict(length=1024, num_samples=2, qa_root=str(FIXTURES / "qa"), cache_dir="")
    return Ruler(**{**args, **kw})


def test_same_seed_tokenizer_version_is_byte_identical(smollm2_tokenizer, tmp_path):
    tasks = ["niah_single_1", "niah_multikey_1", "vt", "cwe", "fwe", "qa_2"]
    first = small(tasks=tasks).build(smollm2_tokenizer)
    again = small(tasks=tasks).build(smollm2_tokenizer)
    cached = small(tasks=tasks, cache_dir=str(tmp_path)).build(smollm2_tokenizer)
    from_cache = small(tasks=tasks, cache_dir=str(tmp_path)).build(smollm2_tokenizer)
    assert first == again == cached == from_cache
    other_seed = small(tasks=tasks, random_seed=43).build(smollm2_tokenizer)
    assert [s.prompt for s in other_seed] != [s.prompt for s in first]


def test_sample_fields(smollm2_tokenizer):
    samples = small(tasks=["niah_multivalue", "qa_1"], num_samples=1).build(smollm2_tokenizer)
    assert [s.id for s in samples] == ["niah_multivalue-1024-0", "qa_1-1024-0"]
    mv, qa = samples
    assert mv.max_new_tokens == 128 and qa.max_new_tokens == 32 and mv.stop == () == qa.stop
    assert len(mv.answers) == 4 and mv.meta["task"] == "niah_multivalue" and mv.meta["length"] == 1024
    assert mv.prompt.endswith(" The special magic numbers for " + mv.prompt.rsplit(" for ", 1)[1])
    assert list(mv.input_ids) == smollm2_tokenizer(mv.prompt).input_ids   # RULER's HF wrapper: tokenizer(prompt)
    assert qa.prompt.endswith(" Answer:") and qa.answers


@pytest.mark.parametrize("length", [2048, 4096])
def test_prompts_hit_the_target_within_upstream_tolerance(length, smollm2_tokenizer):
    """`length` (prompt tokens without special tokens + tokens_to_generate, as upstream counts) never exceeds the
    target (VT's real prompt may, by a few tokens, as upstream's), except FWE, whose 2024 search fills the prompt
    itself up to the target. Below it, the linear search
    leaves up to one haystack increment unused (500 essay words, 25 noise lines or needles, 10 documents...):
    with SmolLM2's tokenizer 25 uuid needles are ~1,750 tokens, so niah_multikey_3 fills only ~57 % of 4096, as
    upstream's own data would. The fill bound here is therefore loose; the exact search is pinned by the fixtures."""
    ds = small(length=length, num_samples=1)
    count = token_counter(smollm2_tokenizer)
    for task in ALL_TASKS:
        (rec,) = ds.records(task, length, smollm2_tokenizer)
        real = count(rec["input"]) + tokens_to_generate(task)
        if task == "vt":  # upstream counts the one-shot example before re-drawing its names and adding "\n\n"
            assert abs(real - rec["length"]) <= 8, (real, rec["length"])
        else:
            assert real == rec["length"]
        limit = length + tokens_to_generate(task) if task == "fwe" else length
        assert 0.5 * length <= rec["length"] <= limit, (task, rec["length"])


def test_cache_serves_prefixes_and_regenerates_for_more(smollm2_tokenizer, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kvbench.data.ruler")
    three = small(tasks=["vt"], num_samples=3, cache_dir=str(tmp_path)).build(smollm2_tokenizer)
    two = small(tasks=["vt"], num_samples=2, cache_dir=str(tmp_path)).build(smollm2_tokenizer)
    assert two == three[:2] and "from the cache" in caplog.text
    (path,) = (tmp_path / "2024-12.1" / "vt").glob("L1024-s42-*.jsonl")
    assert len(path.read_text().splitlines()) == 3
    four = small(tasks=["vt"], num_samples=4, cache_dir=str(tmp_path)).build(smollm2_tokenizer)
    assert four[:3] == three and len(path.read_text().splitlines()) == 4
    small(tasks=["vt"], num_samples=2, cache_dir=str(tmp_path), random_seed=7).build(smollm2_tokenizer)
    assert len(list((tmp_path / "2024-12.1" / "vt").glob("*.jsonl"))) == 2   # seed is part of the key


def test_missing_qa_data_is_skipped_with_a_clear_message(smollm2_tokenizer, tmp_path, caplog):
    ds = small(tasks=["qa_1", "niah_single_1", "qa_2"], num_samples=1, qa_root=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="kvbench.data.ruler"):
        samples = ds.build(smollm2_tokenizer)
    assert [s.meta["task"] for s in samples] == ["niah_single_1"]
    assert "skipping qa_1" in caplog.text and "scripts/download_ruler_qa.py" in caplog.text
    assert set(ds.skipped) == {"qa_1", "qa_2"} and "dev-v2.0.json" in ds.skipped["qa_1"]
    summary = ds.summarize([{"meta": samples[0].meta, "prediction": "x", "references": samples[0].answers}])
    assert set(summary["ruler"]["skipped"]) == {"qa_1", "qa_2"}
    with pytest.raises(ValueError, match="every task was skipped"):
        small(tasks=["qa_1"], qa_root=str(tmp_path)).build(smollm2_tokenizer)


def test_prompt_over_the_models_limit_fails(smollm2_tokenizer):
    with pytest.raises(ValueError, match="max_prompt_tokens=500"):
        small(tasks=["niah_single_1"], num_samples=1).build(smollm2_tokenizer, max_prompt_tokens=500)


@pytest.mark.parametrize("kwargs,match", [
    ({"version": "2025-07.1"}, "names no supported upstream code"),
    ({"tasks": ["niah_singel_1"]}, "Did you mean: niah_single_1"),
    ({"tasks": ["vt", "vt"]}, "without duplicates"),
    ({"lengths": [4096, 4096]}, "distinct positive"),
    ({"num_samples": 0}, "num_samples=0"),
    ({"model_template": "llama3"}, "Unknown model_template 'llama3'"),
])
def test_bad_config_fails_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Ruler(**kwargs)


def test_lengths_list_overrides_length(smollm2_tokenizer):
    samples = small(tasks=["niah_single_1"], lengths=[1024, 2048], num_samples=1).build(smollm2_tokenizer)
    assert [s.id for s in samples] == ["niah_single_1-1024-0", "niah_single_1-2048-0"]


# --- sources and search -----------------------------------------------------------------------------------------

def test_word_pool_is_upstreams():
    words = sources.niah_words()
    assert len(words) == 6_175_260                         # specs/anchor-benchmarks.md §2.4
    assert random.Random(42).choice(words) == "tenuous-hospice"  # §2.9, wonderwords 2.2.0
    assert len(sources.cwe_words()) == 8169


def test_adj_noun_index_equals_the_sorted_set_on_tricky_lists():
    adjs = ["blue", "blue-eyed", "ad hoc", "ad", "a", "x-rated", "blue", "ab", "b", "blue-eyed-x"]
    nouns = ["eyed-cat", "cat", "x-cat", "arch-rival", "zebra", "mother's", "a b", "eyed"]
    expected = sorted({f"{a}-{n}" for a in adjs for n in nouns})
    words = sources.AdjNounWords(adjs, nouns)
    assert len(words) == len(expected) and list(words) == expected and words[-1] == expected[-1]


def test_sentence_splitter_is_offline_punkt():
    split = sentence_splitter()
    assert split("Mr. Smith went to Washington. He arrived at 5 p.m. on Monday. Then he left.") == [
        "Mr. Smith went to Washington.", "He arrived at 5 p.m. on Monday.", "Then he left."]


def test_essay_haystack_is_the_stable_prefix():
    words = sources.essay_words()
    assert len(words) in (111_877, 111_878) and words[:3] == ("July", "2010What", "hard")   # §2.9


def test_wrong_wonderwords_version_is_refused(monkeypatch):
    sources.wonderwords_list.cache_clear()
    monkeypatch.setattr(sources.importlib.metadata, "version", lambda name: "3.0.1")
    try:
        with pytest.raises(RuntimeError, match="wonderwords==2.2.0"):
            sources.wonderwords_list("nounlist.txt")
    finally:
        monkeypatch.undo()
        sources.wonderwords_list.cache_clear()


def test_linear_search_steps_back_once_and_keeps_the_exact_fit_quirk():
    assert linear_search(lambda n: 10 * n, 5, 120) == 10            # 50, 100, 150 > 120 -> back to 10
    assert linear_search(lambda n: 10 * n, 5, 100) == 15            # lands exactly on 100: ends one step up
    assert linear_search(lambda n: 10 * n, 5, 10_000, cap=12, cap_before_step=False) == 12
    assert linear_search(lambda n: 10 * n, 5, 10_000, cap=12, cap_before_step=True) == 12


def test_fit_shrinks_then_gives_up_instead_of_looping_forever():
    tried = []

    def attempt(n):
        tried.append(n)
        if n > 20:
            raise ValueError("too long")
        return n
    assert fit(attempt, 40, 10, "x") == 20 and tried == [40, 30, 20]
    with pytest.raises(RuntimeError, match="raise dataset.length"):
        fit(lambda n: 1 / 0, 20, 10, "x")


def test_tokenizer_fingerprint_tells_tokenizers_apart(smollm2_tokenizer):
    assert tokenizer_fingerprint(smollm2_tokenizer) == tokenizer_fingerprint(smollm2_tokenizer)
    assert tokenizer_fingerprint(smollm2_tokenizer) != tokenizer_fingerprint(Whitespace())


def test_yaml_mirrors_the_dataclass():
    import dataclasses

    from omegaconf import OmegaConf

    from kvbench.runs.config import CONFIG_DIR

    cfg = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "dataset" / "ruler.yaml"))
    fields = {f.name: f for f in dataclasses.fields(Ruler) if f.init}
    assert set(cfg) - {"_target_"} == set(fields)
    for name, f in fields.items():
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        assert cfg[name] == default, name
