"""The static decode step (kvbench.engine.static) compiles whole and decodes what the eager engine decodes.

Per method: `torch.compile(step, fullgraph=True)` over 64 steps of growing lengths, a sequence leaving and another
joining inside the capacity bucket, must make one graph (no graph break, no recompile: dynamo's counters), and every
sample's tokens and cache accounting must equal the eager engine's at batch 1 (the independent reference: the same
methods through `kvbench.engine.batching`, a sample at a time). Dynamo's `eager` backend runs the captured graph op by
op, so the suite checks the capture itself without paying for code generation (inductor and CUDA graphs run the same
graph on a GPU: tests/gpu)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml
import torch._dynamo
from torch._dynamo.utils import counters

import kvbench.methods  # noqa: F401
from kvbench.engine.batching import Request, generate_batched
from kvbench.engine.static import StaticDecoder, unsupported
from kvbench.models import AttentionCapture
from tests.unit.test_contract import configured
from tests.unit.tiny import prompt, tiny_model

CAPTURED = ("full", "streamingllm", "snapkv", "pyramidkv", "adakv", "kvzip", "h2o", "tova", "keyformer", "buzz",
            "keyformer selection=code_frozen", "buzz logn=True", "streamingllm_rolling")
LENGTHS, NEW = (150, 70, 120), (64, 10, 20)  # 64 steps for the first; the second leaves, the third joins its row
FIELDS = ("token_ids", "kv_bytes", "kv_bytes_final", "kept_per_head", "kv_bytes_per_layer", "kv_bytes_per_layer_final",
          "peak_kv_bytes", "kv_bytes_decode_peak", "kv_bytes_decode_mean")


def requests(budget):
    return [Request(prompt(n, seed=i), budget, new, seed=100 + i, tag=i)
            for i, (n, new) in enumerate(zip(LENGTHS, NEW))]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2)


@pytest.mark.parametrize("case", CAPTURED)
def test_the_static_step_compiles_once_and_decodes_as_the_eager_engine(model, case):
    name, *settings = case.split()
    method, budget = configured(name), None if name == "full" else 48
    for setting in settings:  # a variant whose rule keeps its own device state (frozen key set, log n scale)
        key, value = setting.split("=")
        method = dataclasses.replace(method, **{key: yaml.safe_load(value)})
    with AttentionCapture(model, window=method.query_window) as capture:
        eager = {r.tag: g for r, g in generate_batched(model, None, method, capture, requests(budget), 1)}
        torch._dynamo.reset()
        counters.clear()
        decoder = StaticDecoder(model, None, method, capture, 2, eos_ids=set(), compile=True, backend="eager")
        with torch._dynamo.config.patch(error_on_recompile=True):
            captured = {r.tag: g for r, g in decoder.run(requests(budget))}
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 1
    for i, one in eager.items():
        assert not isinstance(captured[i], Exception), captured[i]
        assert captured[i].step == "captured" and one.step == "eager"
        for field in FIELDS:
            assert getattr(captured[i], field) == getattr(one, field), (i, field)
    assert [len(eager[i].token_ids) for i in range(3)] == list(NEW)


def test_a_sequence_beyond_the_bucket_gets_larger_rows_and_one_more_graph(model):
    """The counters above can fail: a prompt joining, beside a sequence still decoding, whose entries and new tokens
    exceed the rows' capacity (256) makes larger rows, the held row copied over, and so a second graph; tokens still
    equal the eager engine's."""
    method = configured("full")

    def three():
        return [Request(prompt(n, seed=i), None, new, tag=i)
                for i, (n, new) in enumerate(((100, 40), (80, 4), (300, 8)))]

    with AttentionCapture(model, window=0) as capture:
        eager = {r.tag: g.token_ids for r, g in generate_batched(model, None, method, capture, three(), 1)}
        torch._dynamo.reset()
        counters.clear()
        decoder = StaticDecoder(model, None, method, capture, 2, eos_ids=set(), compile=True, backend="eager")
        captured = {r.tag: g.token_ids for r, g in decoder.run(three())}
    assert captured == eager
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]


REFUSED = {"tailorkv": "own storage", "rkv": "compression while decoding"}  # quest, pqcache: test_static_retrieval.py


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_the_static_step_cannot_run_is_named(name):
    assert REFUSED[name] in unsupported(configured(name))


@pytest.mark.parametrize("overrides, reason", [
    (["method=keyformer", "method.score=shared", "step=captured"], "decides across layers"),
    (["method=snapkv", "step=static", "positions=shift"], "positions=shift"),
    (["method=snapkv", "step=static", "decode_compression.target=64"], "compression while decoding"),
    (["method=snapkv", "step=static", "generation.num_beams=2"], "beam search"),
])
def test_setup_refuses_the_static_step_in_one_line_before_weights_load(overrides, reason):
    from hydra import compose, initialize_config_dir

    from kvbench.runs.config import CONFIG_DIR, setup

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["model=tiny_llama", *overrides])
    with pytest.raises(ValueError) as error:
        setup(cfg)
    assert reason in str(error.value) and "step=eager" in str(error.value) and "\n" not in str(error.value)
