"""query=agnostic on the embedded SmolLM2 (slow) with NIAH, RULER and the LongBench fixtures: each benchmark's own
split (`prompt_split`), `full` generating what query=aware generates (one cache, the same tokens), and
`python -m kvbench.run query=agnostic method=snapkv budget=64` (through `kvbench.runs.run`, in this process, as
tests/integration/test_seed_tasks.py does) compressing the context alone and keeping the question on top."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import open_dict

import kvbench.methods  # noqa: F401
from kvbench.engine.batching import generate
from kvbench.models import AttentionCapture, ModelSpec, load
from kvbench.registry import METHODS
from kvbench.runs.config import CONFIG_DIR, setup
from kvbench.runs.run import prompt_split, run

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CASES = {  # dataset -> (overrides: one short sample, few new tokens; where its question part starts)
    "niah": (["dataset.context_lengths=[400]", "dataset.depth_percents=[50]", "dataset.max_new_tokens=8"],
             " Based on the content of the book, Question:"),
    "ruler": (["dataset.length=1024", "dataset.num_samples=1", "dataset.tasks=[qa_1]",
               f"dataset.qa_root={FIXTURES / 'ruler' / 'qa'}"],
              "Answer the question based on the given documents. Only give me the answer and do not output any other "
              "words.\n\nQuestion:"),
    "longbench": ([f"dataset.root={FIXTURES / 'longbench'}", "dataset.tasks=[qasper]", "dataset.limit_per_task=1",
                   "dataset.max_new_tokens=8"], "Answer the question based on the above article"),
}


def compose_cfg(tmp_path: Path, dataset: str, *overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"dataset={dataset}", "report=false", f"results_dir={tmp_path}",
                                           *CASES[dataset][0], *overrides], return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    run_dir = Path(cfg.hydra.run.dir)
    with open_dict(cfg):
        if dataset == "ruler":
            cfg.dataset.cache_dir = str(tmp_path / "ruler-cache")
        del cfg["hydra"]
    return cfg, run_dir


@pytest.fixture(scope="module")
def smollm2():
    return load(ModelSpec(name="smollm2", path="embedded"))  # one thread (conftest): 2 on a busy box is 10x slower


@pytest.mark.parametrize("dataset", list(CASES))
def test_split_and_full_cache_agnostic_generates_what_aware_generates(smollm2, tmp_path, dataset):
    model, tok = smollm2
    cfg, _ = compose_cfg(tmp_path, dataset)
    spec = ModelSpec(**{k: v for k, v in cfg.model.items()})
    sample = instantiate(cfg.dataset).build(tok, spec.max_prompt_tokens)[0]
    ids, n_context = prompt_split(sample, tok, spec)
    # the question part, and only it (whitespace at the seam may go either way)
    assert tok.decode(ids[n_context:]).lstrip().startswith(CASES[dataset][1].strip())
    assert CASES[dataset][1].strip() not in tok.decode(ids[:n_context])
    out, first = {}, {}
    with AttentionCapture(model) as capture:
        for q in (0, len(ids) - n_context):
            out[q] = generate(model, tok, METHODS["full"](), capture, torch.tensor([ids]), None, 8, sample.stop,
                              question_len=q, on_logits=lambda t, logits: first.setdefault(q, logits.clone()))
    assert out[0].token_ids == out[len(ids) - n_context].token_ids
    torch.testing.assert_close(first[0], first[len(ids) - n_context], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dataset", list(CASES))
def test_snapkv_64_agnostic_runs_end_to_end(tmp_path, dataset):
    cfg, run_dir = compose_cfg(tmp_path, dataset, "method=snapkv", "budget=64", "query=agnostic")
    run(cfg, run_dir, setup(cfg))
    records = [json.loads(x) for x in (run_dir / "predictions.jsonl").read_text().splitlines()]
    assert records and json.loads((run_dir / "manifest.json").read_text())["query"] == "agnostic"
    for r in records:  # 64 context entries per head and layer, then the whole question on top
        assert "error" not in r and r["query"] == "agnostic" and 0 < r["question_tokens"] < r["prompt_tokens"]
        assert r["effective_budget"] == 64 + r["question_tokens"]
        per_token = r["full_kv_bytes"] / r["prompt_tokens"]  # the whole uncompressed prompt's
        assert r["kv_bytes"] == per_token * (64 + r["question_tokens"])
