"""Shared fixtures. Unit tests use one torch thread: on 2 shared vCPUs, 2 threads can be 30x slower."""
from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)

# `make test` runs two workers, each taking whole files (`-n 2 --dist loadfile --no-loadscope-reorder`): the files
# that run many processes go first, so that the longest one (every paper's smoke form, ~2 minutes) is not the tail.
FIRST = ("tests/integration/test_paper_smoke.py", "tests/unit/test_cluster.py", "tests/unit/test_grid.py",
         "tests/unit/test_shard_cli.py", "tests/unit/test_ruler_cli.py", "tests/unit/test_cli.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Heavy files first (a stable sort: each file's tests keep their order)."""
    rank = {path: i for i, path in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(FIRST)))


@pytest.fixture(scope="session")
def smollm2_dir():
    """The converted embedded SmolLM2 folder (converted once per machine into ~/.cache/kvbench)."""
    from kvbench.models.embedded import embedded_model_dir

    return embedded_model_dir()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="session")
def embedded_views():
    """The prompts of tests/fixtures/kvpress_new/goldens.json prefilled once each on the embedded model, as the views
    `select` gets (every query recorded; a method slices its own): (that file's JSON, views per prompt and layer).
    Session-wide: every kvpress golden test (tests/unit/test_presses*.py) shares one load and prefill."""
    import json
    from pathlib import Path

    from kvbench.cache import KVCache
    from kvbench.engine.generation import prefill
    from kvbench.methods.base import LayerView
    from kvbench.models import AttentionCapture, ModelSpec, load

    goldens = json.loads((Path(__file__).parent / "fixtures/kvpress_new/goldens.json").read_text())
    model, _ = load(ModelSpec(name="smollm2", path="embedded"))
    views = []
    with AttentionCapture(model, window=1 << 40) as capture:  # every query (non_causal_attn); others slice theirs
        for golden in goldens["prompts"]:
            cache = KVCache()
            with torch.no_grad():
                prefill(model, torch.tensor([golden["ids"]]), cache)
            views.append([LayerView(i, len(cache.layers), layer.keys, layer.values, capture.window_queries[i],
                                    capture.scaling[i], rotary=capture.rotary.get(i),
                                    output_weight=capture.output_weight(i))
                          for i, layer in enumerate(cache.layers)])
    return goldens, views
