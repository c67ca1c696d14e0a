"""The methods added for issue 22 (knorm, tova, expected_attention, Keyformer's shared score) through the whole
command path on the tiny model, every dataset at least once (fixtures for the downloaded ones): generation records,
perplexity streams (an evictor inside a teacher-forced stream), fixed-length latency prompts. Each run keeps at most
the budget per head. (Every method x every dataset was run by hand; CI runs this rotation to stay fast.)"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_cli import records, run_here

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
DATASETS = {
    "niah": ["dataset.context_lengths=[300]", "dataset.depth_percents=[50]"],
    "ruler": ["dataset.length=1024", "dataset.tasks=[vt]", "dataset.num_samples=1"],
    "longbench": [f"dataset.root={FIXTURES / 'longbench'}", "dataset.tasks=[trec]", "dataset.limit_per_task=1"],
    "infinitebench": [f"dataset.root={FIXTURES / 'infinitebench'}", "dataset.tasks=[passkey]",
                      "dataset.max_new_tokens=4"],
    "cnn_dailymail": [f"dataset.root={FIXTURES / 'cnn_dailymail'}", "dataset.max_new_tokens=4"],
    "xsum": [f"dataset.root={FIXTURES / 'xsum'}", "dataset.max_new_tokens=4"],
    "lost_in_the_middle": [f"dataset.root={FIXTURES / 'lost_in_the_middle'}", "dataset.max_new_tokens=4"],
    "wikitext_ppl": [f"dataset.root={FIXTURES / 'wikitext_ppl'}", "dataset.num_rows=4"],
    "fixed_length": ["dataset.prompt_lengths=[64]", "dataset.generation_lengths=[4]"],
}
ROTATION = [
    ("knorm", [], ["niah", "infinitebench"]),
    ("tova", [], ["wikitext_ppl", "ruler"]),
    ("expected_attention", ["method.window=16"], ["longbench", "lost_in_the_middle", "xsum"]),
    ("keyformer", ["method.score=shared"], ["cnn_dailymail", "fixed_length"]),
]


def test_rotation_covers_every_dataset():
    assert sorted(d for _, _, names in ROTATION for d in names) == sorted(DATASETS)


@pytest.mark.parametrize("method,knobs,datasets", ROTATION, ids=[r[0] for r in ROTATION])
def test_new_methods_run_the_datasets(tmp_path, method, knobs, datasets):
    for dataset in datasets:
        run_dir = run_here("model=tiny_llama", f"method={method}", "budget=32", f"dataset={dataset}", "limit=1",
                           "report=false", *knobs, *DATASETS[dataset], results=tmp_path / dataset)
        recs = records(run_dir)
        assert recs and all(max(r["kept_per_layer"]) <= 32 for r in recs), (dataset, recs[0].keys())
