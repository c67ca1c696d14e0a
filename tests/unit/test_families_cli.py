"""The command line on a saved tiny checkpoint of every supported family (`save_pretrained`, the embedded tokenizer
beside it): `model=hf model.path=<dir> method=snapkv budget=32 dataset=niah` runs and compresses each one; an
unsupported architecture is refused in one line from its config.json, before any weights would load."""
from __future__ import annotations

import json

import pytest

from kvbench.models.adapters import BY_FAMILY
from kvbench.models.loader import RANDOM_FAMILIES
from kvbench.models.tiny import tiny_random_model
from kvbench.runs.validate import validate
from tests.unit.test_cli import records, refusal, run_dirs, run_here

NIAH = ["dataset=niah", "dataset.context_lengths=[300]", "dataset.depth_percents=[50]", "dataset.max_new_tokens=4",
        "report=false"]  # (the heatmap and summary: test_cli.py; here the records and the manifest)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, smollm2_tokenizer):
    """{family: directory} of tiny random models saved the way a user's checkpoint is."""
    dirs = {}
    for family in RANDOM_FAMILIES:
        path = tmp_path_factory.mktemp(family)
        model = tiny_random_model(family, vocab_size=len(smollm2_tokenizer), layers=2,
                                  bos_token_id=smollm2_tokenizer.bos_token_id,
                                  eos_token_id=smollm2_tokenizer.eos_token_id)
        model.save_pretrained(path)
        smollm2_tokenizer.save_pretrained(path)
        dirs[family] = path
    return dirs


def test_snapkv_runs_on_every_family_from_a_local_checkpoint(checkpoints, tmp_path):
    """`python -m kvbench.run -m model=hf model.path=<dir>,<dir>,... ...`, in this process: the command's checks pass
    for the whole sweep (one job per family, every checkpoint's config.json read), then each family's job as the
    command runs it (run_here: the composed config, its run directory, setup and run). The command line as a
    process, a multirun included, is test_cli.py's, test_grid.py's and test_validate.py's."""
    args = ["model=hf", "model.name=tiny", "model.dtype=float32", "model.device=cpu", "method=snapkv",
            "method.window=8", "budget=32", *NIAH]
    paths = ",".join(str(checkpoints[f]) for f in RANDOM_FAMILIES)
    assert validate(["-m", *args, f"model.path={paths}", f"results_dir={tmp_path}"]) == len(RANDOM_FAMILIES)
    by_family = {}
    for family in RANDOM_FAMILIES:
        run_dir = run_here(*args, f"model.path={checkpoints[family]}", results=tmp_path)
        manifest = json.loads((run_dir / "manifest.json").read_text())
        assert manifest["model_source"] == str(checkpoints[family])
        by_family[family] = records(run_dir)[0]
    assert len(run_dirs(tmp_path)) == len(RANDOM_FAMILIES)
    for family, record in by_family.items():
        config = tiny_random_model(family).config
        window = BY_FAMILY[family].window_layers(config)  # window layers: the last sliding_window - 1 entries
        expected = [config.sliding_window - 1 if i in window else 32.0 for i in range(2)]
        assert record["kept_per_layer"] == expected, family
        assert record["kv_bytes"] < record["full_kv_bytes"]


def test_an_unsupported_architecture_is_refused_before_loading(tmp_path):
    (tmp_path / "t5").mkdir()
    (tmp_path / "t5" / "config.json").write_text(json.dumps({"model_type": "t5", "is_encoder_decoder": True}))
    line = refusal("model=hf", f"model.path={tmp_path / 't5'}", "method=snapkv", "budget=64", results=tmp_path / "res")
    assert line.startswith("kvbench: model: model_type 't5' is an encoder-decoder model"), line
