"""RULER's constants are upstream's byte for byte (NVIDIA/RULER c5341b4).

The hashes are sha256(json.dumps(obj, sort_keys=True)) of upstream's `Templates` (scripts/data/template.py),
`TASKS` (scripts/data/synthetic/constants.py) and `yaml.safe_load(scripts/synthetic.yaml)`, computed from the
pinned commit; a few strings are spelled out as well, so a failure shows what moved.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np

from kvbench.data.ruler import niah
from kvbench.data.ruler.templates import (ALL_TASKS, CODE_VERSIONS, MODEL_TEMPLATES, TASK_CONFIGS, TASKS,
                                          prompt_template, task_metric, tokens_to_generate)

UPSTREAM_SHA256 = {
    "templates": "51ea288d67dadd7c89193d2a7d9d9fc312105843965baa195c1f7cad12c096ad",
    "tasks": "d24a0d486f1fb7da73fd6e1999f532ada8b96155772a363b60441d2e069400de",
    "synthetic": "bcd670bdec89cf4639fae6f8fb6117ee40da2b63234376d7a0cd33ecf5effdc7",
}


def sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def test_constants_hash_to_upstream():
    assert sha(MODEL_TEMPLATES) == UPSTREAM_SHA256["templates"]
    assert sha(TASKS) == UPSTREAM_SHA256["tasks"]
    assert sha({t: {"task": f, "args": a} for t, (f, a) in TASK_CONFIGS.items()}) == UPSTREAM_SHA256["synthetic"]


def test_pinned_code_version():
    assert CODE_VERSIONS == {"2024-12": "NVIDIA/RULER@c5341b4"}


def test_task_list_order_and_metrics():
    assert ALL_TASKS == ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
                         "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2"]
    assert {t: tokens_to_generate(t) for t in ("niah_single_1", "vt", "cwe", "fwe", "qa_1")} == \
        {"niah_single_1": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa_1": 32}
    assert [t for t in ALL_TASKS if task_metric(t) == "string_match_part"] == ["qa_1", "qa_2"]


def test_answer_prefixes_spelled_out():
    assert TASKS["variable_tracking"]["answer_prefix"] == (
        " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
        "assgined the value {query}, they are: ")  # the 2024 typo is part of the data
    assert TASKS["qa"]["answer_prefix"] == " Answer:"
    assert prompt_template("cwe").endswith(
        "above list? Answer: The top 10 words that appear most often in the list are:")
    assert prompt_template("qa_1", "meta-chat").startswith("[INST] Answer the question")
    assert prompt_template("qa_1", "meta-chat").endswith("Question: {query} [/INST] Answer:")


def test_niah_singular_rendering_matches_the_spec():
    """specs/anchor-benchmarks.md §2.4, the rendered base template of a single-needle task (verified upstream)."""
    template = prompt_template("niah_single_1")
    for a, b in [("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")]:
        template = template.replace(a, b)
    assert template.format(type_needle_v="number", context="C", query="Q") == (
        "A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you about "
        "the number afterwards.\nC\nWhat is the special magic number for Q mentioned in the provided text? The "
        "special magic number for Q mentioned in the provided text is")


def test_depths_are_numpys():
    assert niah.DEPTHS == [int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int)]
