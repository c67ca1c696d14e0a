"""The seed tasks end to end on the embedded SmolLM2 with the self-written fixtures (slow): what
`python -m kvbench.run dataset=<name> method=snapkv budget=64 limit=2 dataset.root=tests/fixtures/<name>` does
(`kvbench.runs.config.setup` + `kvbench.runs.run.run`, in this process so the model is loaded from the converted
cache each time, not re-imported), and Wikitext streaming perplexity with H2O evicting during the stream."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from kvbench.runs.config import CONFIG_DIR, setup
from kvbench.runs.run import run

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CASES = {  # dataset -> (extra overrides, scores.json table)
    "cnn_dailymail": (["dataset.max_new_tokens=4"], "summarization"),
    "xsum": (["dataset.max_new_tokens=4", "dataset.protocol=keyformer"], "summarization"),
    "lost_in_the_middle": (["dataset.max_new_tokens=4", "dataset.gold_positions=[9]"], "lost_in_the_middle"),
    "wikitext_ppl": (["dataset.num_rows=4"], "perplexity"),
    "infinitebench": (["dataset.max_new_tokens=4", "dataset.tasks=[passkey,longbook_qa_eng]"], "infinitebench"),
}


def kvbench_run(tmp_path: Path, dataset: str, *overrides: str) -> dict:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"dataset={dataset}", f"dataset.root={FIXTURES / dataset}", "report=false",
                                           *overrides], return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)  # `run` reads the group choices from it
        run_dir = tmp_path / dataset / cfg.hydra.runtime.choices.method
        with open_dict(cfg):
            del cfg["hydra"]  # as in a real run, the job's config has no hydra node
        summary = run(cfg, run_dir, setup(cfg))
    summary["records"] = [json.loads(x) for x in (run_dir / "predictions.jsonl").read_text().splitlines()]
    return summary


@pytest.mark.parametrize("dataset", list(CASES))
def test_snapkv_budget_64_limit_2(tmp_path, dataset):
    overrides, table = CASES[dataset]
    s = kvbench_run(tmp_path, dataset, "method=snapkv", "budget=64", "limit=2", *overrides)
    assert s["primary_metric"] in s["metrics"] and table in s
    assert s["n"] == (1 if dataset == "wikitext_ppl" else 2)
    if dataset != "wikitext_ppl":
        assert s["kv_ratio"] < 1  # the prompts are longer than 64 tokens: SnapKV compressed


def test_wikitext_stream_h2o_evicts_during_the_stream(tmp_path):
    s = kvbench_run(tmp_path, "wikitext_ppl", "method=h2o", "budget=16", "dataset.num_rows=4")
    (record,) = s["records"]
    assert record["evicts_in_stream"] and max(record["kept_per_layer"]) <= 16 < record["n_tokens"]
    assert s["perplexity"]["ppl"] == pytest.approx(record["scores"]["ppl_stream"]) and s["perplexity"]["ppl"] > 1
