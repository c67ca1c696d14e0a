"""RULER at short lengths (SmolLM2's tokenizer). Where not one step of a task's haystack fits, upstream (c5341b4)
either retries forever or builds a sample with nothing to find (cwe with no words, outputs []), which its
string_match_all then divides by; kvbench refuses such a length before weights load, naming per task the smallest
length that builds. The essay tasks below one 500-word step are upstream's needle-only samples, kept with a warning."""
from __future__ import annotations

import logging
import re

import pytest

from kvbench.data.ruler import Ruler, cache, generate_task
from kvbench.data.ruler.length import NoFit, smallest_fitting, token_counter


def smallest_named(message: str, task: str) -> int:
    found = re.search(rf"\b{task} \(builds from (\d+)\)", message)
    assert found, message
    return int(found.group(1))


def builds(task: str, length: int, count, num_samples: int) -> bool:
    """An independent check of a named length: generation itself, every sample with something to find."""
    try:
        records = generate_task(task, count, length, num_samples)
    except RuntimeError:
        return False
    return all(r["outputs"] for r in records)


def test_cwe_with_no_word_that_fits_is_refused_not_built_empty(smollm2_tokenizer):
    """At 512 the first 10-word step of cwe does not fit: upstream builds an empty sample (answer []); on the old
    code it passed the length check and the run failed at scoring, after weights had loaded."""
    with pytest.raises(RuntimeError, match="cwe at length 512: sample 0 has no answer"):
        generate_task("cwe", token_counter(smollm2_tokenizer), 512, 1)
    with pytest.raises(ValueError, match=r"ruler: dataset.length=512 is too small for cwe \(builds from \d+\)"):
        Ruler(tasks=["cwe", "niah_single_1"], length=512, num_samples=2, cache_dir="").check_fits(smollm2_tokenizer)


def test_fwe_below_its_smallest_vocabulary_or_template_is_refused(smollm2_tokenizer):
    """fwe's vocabulary is length // 50 words, the first one noise: below 100 upstream crashes (IndexError, no word)
    or asks for nothing; where the bare template is over the length (vicuna-chat at 100) it shrinks forever."""
    count = token_counter(smollm2_tokenizer)
    for length in (40, 99):
        with pytest.raises(NoFit, match="gives a vocabulary of"):
            generate_task("fwe", count, length, 1)
    with pytest.raises(NoFit, match="the template alone is over max_seq_length=100"):
        generate_task("fwe", count, 100, 1, model_template="vicuna-chat")
    assert generate_task("fwe", count, 100, 1)[0]["outputs"]  # the base template fits: one word to find


def test_the_command_line_refuses_cwe_at_512_in_one_line_before_weights_load(tmp_path, monkeypatch):
    """The defect as a user met it: `python -m kvbench.run dataset=ruler dataset.length=512 ...` loaded the model,
    ran cwe's empty samples and failed at scoring (ZeroDivisionError); now validation stops it with one line."""
    from kvbench.runs.validate import BadInput, validate

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(BadInput) as error:
        validate(["model=tiny_llama", "method=snapkv", "budget=64", "dataset=ruler", "dataset.length=512",
                  "dataset.tasks=[cwe]", "dataset.num_samples=1", f"dataset.cache_dir={tmp_path / 'cache'}",
                  f"results_dir={tmp_path / 'results'}"])
    assert "ruler: dataset.length=512 is too small for cwe (builds from " in str(error.value)
    assert "\n" not in str(error.value) and not (tmp_path / "results").exists()


def test_refusal_names_the_smallest_length_that_builds_for_each_task(smollm2_tokenizer):
    tasks = ["niah_single_1", "niah_single_2", "cwe"]
    with pytest.raises(ValueError) as error:
        Ruler(tasks=tasks, length=256, num_samples=2, cache_dir="").check_fits(smollm2_tokenizer)
    message = str(error.value)
    assert "\n" not in message and "niah_single_2" not in message  # needle-only samples build (upstream's)
    count = token_counter(smollm2_tokenizer)
    for task in ["niah_single_1", "cwe"]:
        smallest = smallest_named(message, task)
        assert builds(task, smallest, count, 2) and not builds(task, smallest - 1, count, 2), task


def test_a_cached_file_without_answers_is_refused(smollm2_tokenizer, monkeypatch, tmp_path):
    """Files cached before the refusal (cwe at 512-856 with SmolLM2) are not served."""
    monkeypatch.setattr(cache, "cached", lambda path, n, make, key: ([{"index": 0, "input": "x", "outputs": [],
                                                                       "length": 300}], True))
    with pytest.raises(RuntimeError, match="has no answer"):
        Ruler(tasks=["cwe"], length=512, num_samples=1, cache_dir=str(tmp_path)).records("cwe", 512,
                                                                                        smollm2_tokenizer)


def test_essay_tasks_below_one_step_are_upstreams_needle_only_samples(smollm2_tokenizer, caplog):
    with caplog.at_level(logging.WARNING, logger="kvbench.data.ruler.niah"):
        (record,) = generate_task("niah_single_2", token_counter(smollm2_tokenizer), 512, 1)
    assert "holds the needles alone" in caplog.text
    needle = "One of the special magic numbers for "
    context = record["input"].split("afterwards.\n", 1)[1].split("\nWhat is", 1)[0]
    assert context.strip().startswith(needle) and context.strip().endswith(f"is: {record['outputs'][0]}.")


def test_smallest_fitting_doubles_then_bisects():
    tried = []

    def at_least_37(n: int) -> bool:
        tried.append(n)
        return n >= 37
    assert smallest_fitting(at_least_37, 5, 1000) == 37 and tried[:3] == [10, 20, 40]
    assert smallest_fitting(lambda n: False, 5, 100) is None
    assert smallest_fitting(lambda n: True, 5, 100) == 6
