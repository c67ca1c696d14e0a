"""The reasoning sets' graders and prompts equal their references on hand-picked cases, each run through both:
lm-evaluation-harness's own GSM8K tasks (its YAMLs, `RegexFilter`, `process_results` and few-shot context) on the
gsm8k fixture, and direct math-verify calls for MATH-500 / AIME."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import yaml

from kvbench.data.base import Sample
from kvbench.data.gsm8k import Gsm8k
from kvbench.metrics.reasoning import FLEXIBLE, STRICT, answered, math_verify, regex_extract

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TASK_FILES = {"gsm8k": "gsm8k.yaml", "gsm8k_cot": "gsm8k-cot.yaml"}

# responses a model might give (the few-shot format, CoT phrasing, money, commas, a second number after the answer,
# negatives, a trailing period, nothing numeric, an answer followed by a new question)
GSM8K_RESPONSES = [
    " She keeps 36 - 11 = 25 rolls.\n#### 25", " #### 25.", " The answer is 25.", " The answer is $26.",
    " #### $26", " It costs $26.00 in total.", " 1,200 / 4 = 300, so 900 remain.\n#### 900",
    " The answer is 1,200 - 300 = 900.", " #### 900 books", " The answer is -5.", " #### -5", " minus 5",
    " I am not sure.", " #### 25\n\nQuestion: what next?", " 25", " 3 - 8 = -5 so it is -5 degrees", " .5",
    " THE ANSWER IS 26.", " 25 or 26? The answer is 26.", "",
]


def lm_eval_task(protocol: str, tmp_path: Path):
    """lm-eval's own task, from its installed YAML, reading the fixture's jsonl instead of the Hub."""
    import lm_eval
    from lm_eval.api.task import ConfigurableTask

    path = Path(os.path.dirname(lm_eval.__file__)) / "tasks" / "gsm8k" / TASK_FILES[protocol]
    config = yaml.safe_load(path.read_text())
    config.pop("tag", None)
    config.update(dataset_path="json", dataset_name=None, dataset_kwargs={
        "data_files": {s: str(FIXTURES / "gsm8k" / f"{s}.jsonl") for s in ("train", "test")},
        "cache_dir": str(tmp_path / "hf-datasets")})
    task = ConfigurableTask(config=config)
    task.set_fewshot_seed(1234)  # simple_evaluate's default fewshot_random_seed
    return task


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    return {p: lm_eval_task(p, tmp_path_factory.mktemp(p)) for p in TASK_FILES}


@pytest.mark.parametrize("protocol", list(TASK_FILES))
def test_gsm8k_prompts_equal_lm_eval_fewshot_context(tasks, protocol):
    """Byte for byte, document by document in order: lm-eval draws the gsm8k examples from one seeded generator."""
    task, ours = tasks[protocol], Gsm8k(root=str(FIXTURES / "gsm8k"), protocol=protocol).build(None)
    docs = list(task.test_docs())
    assert [s.prompt for s in ours] == [task.fewshot_context(d, task.config.num_fewshot) for d in docs]
    assert {s.stop for s in ours} == {tuple(u for u in task.config.generation_kwargs["until"])}
    assert ours[0].prompt.count("Question:" if protocol == "gsm8k" else "Q:") == (6 if protocol == "gsm8k" else 9)
    assert ours[0].prompt[ours[0].context_end:] == ("Question: " if protocol == "gsm8k" else "Q: ") + docs[0][
        "question"] + ("\nAnswer:" if protocol == "gsm8k" else "\nA:")


@pytest.mark.parametrize("protocol", list(TASK_FILES))
def test_gsm8k_graders_equal_lm_eval_filters_and_exact_match(tasks, protocol):
    """lm-eval's path: each filter of the YAML (RegexFilter, then take_first), then the task's process_results
    (exact_match with its regexes_to_ignore and ignore_case against doc_to_target)."""
    from lm_eval.filters.extraction import RegexFilter

    task = tasks[protocol]
    filters = {f["name"]: f["filter"][0] for f in task.config.filter_list}
    assert filters["strict-match"]["regex_pattern"] == STRICT[protocol]
    assert filters["flexible-extract"]["regex_pattern"] == FLEXIBLE
    ds = Gsm8k(root=str(FIXTURES / "gsm8k"), protocol=protocol)
    hits = 0
    for doc, sample in zip(task.test_docs(), ds.build(None)):
        for response in GSM8K_RESPONSES:
            theirs = {}
            for name, ours_name in (("strict-match", "strict_match"), ("flexible-extract", "flexible_extract")):
                spec = {k: v for k, v in filters[name].items() if k != "function"}
                (extracted,), = RegexFilter(**spec).apply([[response]], [doc])
                theirs[ours_name] = task.process_results(doc, [extracted])["exact_match"]
            assert ds.score(sample, response) == theirs, (protocol, sample.id, response)
            hits += sum(theirs.values())
    assert hits >= 10  # the cases are not all misses


def test_regex_extract_edge_cases():
    """RegexFilter's rules: the group_select-th match, the first non-empty group of a tuple, stripped, or
    "[invalid]"."""
    assert regex_extract("a 12 b 3,4", FLEXIBLE, -1) == "3,4"
    assert regex_extract("x 7 y", FLEXIBLE, -1) == "7"  # one digit: the second group
    assert regex_extract("no digits", FLEXIBLE, -1) == "[invalid]"
    assert regex_extract("The answer is 5.", STRICT["gsm8k_cot"]) == "5"


# (response, gold, expected): boxed, fractions, units, several boxes, no answer, AIME's zero padding
MATH_CASES = [
    ("So the answer is $\\boxed{\\frac{3}{4}}$.", "\\frac{3}{4}", 1.0),
    ("Final answer:  \\boxed{0.75}", "\\frac{3}{4}", 1.0),
    ("\\boxed{3/4}", "\\frac{3}{4}", 1.0),
    ("The answer is \\boxed{\\dfrac{6}{8}}", "\\frac{3}{4}", 1.0),
    ("\\boxed{\\frac{4}{3}}", "\\frac{3}{4}", 0.0),
    ("The length is \\boxed{5 \\text{ cm}}.", "5", 1.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{\\$32,348}", "\\$32,348", 1.0),
    ("First \\boxed{2}, then \\boxed{3}.", "3", 0.0),  # boxes in one clause: the set {2, 3}
    ("\\boxed{2} and \\boxed{5}", "2, 5", 1.0),
    ("I could not solve it.", "6", 0.0),
    ("", "6", 0.0),
    ("so x = 6", "6", 1.0),  # no box: the last expression
    ("\\boxed{(2, 3)}", "(2, 3)", 1.0),
    ("\\boxed{(3, 2)}", "(2, 3)", 0.0),
    ("\\boxed{5\\sqrt{2}}", "5\\sqrt{2}", 1.0),
    ("\\boxed{\\sqrt{50}}", "5\\sqrt{2}", 1.0),
    ("\\boxed{23}", "023", 1.0),
    ("\\boxed{218}", "218", 1.0),
    ("<think>maybe \\boxed{7}</think> The answer is \\boxed{11}.", "11", 1.0),  # a later sentence's box wins
    ("Maybe \\boxed{7}. The answer is \\boxed{11}.", "7", 0.0),
]


@pytest.mark.parametrize("response,gold,expected", MATH_CASES)
def test_math_verify_grader_is_a_direct_math_verify_call(response, gold, expected):
    from math_verify import parse, verify

    reference = float(verify(parse("$" + gold + "$"), parse(response)))
    assert math_verify(response, [gold]) == reference == expected
    assert answered(response, [gold]) == float("boxed{" in response)


def test_math_verify_off_the_main_thread():
    """math-verify's SIGALRM timeouts only work on the main thread; elsewhere the grader turns them off."""
    out = []
    worker = threading.Thread(target=lambda: out.append(math_verify("\\boxed{\\frac{1}{2}}", ["0.5"])))
    worker.start()
    worker.join()
    assert out == [1.0]


def test_math_scores_through_the_dataset():
    from kvbench.data.reasoning import Math500

    ds = Math500(root=str(FIXTURES / "math500"))
    sample = Sample("math500-000", "p", ["\\frac{3}{4}"], 8)
    assert ds.score(sample, "\\boxed{\\frac34}") == {"math_verify": 1.0, "answered": 1.0}
    assert ds.score(sample, "three quarters") == {"math_verify": 0.0, "answered": 0.0}
