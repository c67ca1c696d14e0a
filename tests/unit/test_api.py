"""The Python API (kvbench.runs.api): a RunSpec composes and checks as the command line does (one-line refusals,
before weights load), and an Engine generates several prompts together with the same tokens and KV bytes as each
prompt alone through the engine's batch of one (the independent reference), bytes counted by hand."""
from __future__ import annotations

import pytest
import torch

import kvbench
from kvbench.engine.batching import generate
from kvbench.runs.api import Engine, Run, RunSpec

torch.set_num_threads(1)
ENTRY = 2 * 2 * 2 * 16 * 4  # tiny_llama: 2 layers x 2 KV heads x head_dim 16, keys and values, fp32


def test_the_package_exports_the_api_lazily():
    assert kvbench.RunSpec is RunSpec and kvbench.Engine is Engine and kvbench.Run is Run
    with pytest.raises(AttributeError, match="no attribute 'Engin'"):
        kvbench.Engin  # noqa: B018


def test_a_spec_is_the_command_line_it_stands_for():
    spec = RunSpec(method="snapkv", budget=64, model="tiny_llama", generation={"do_sample": True, "top_k": 5},
                   overrides=("method.window=8",))
    assert spec.as_overrides() == ["model=tiny_llama", "method=snapkv", "dataset=niah", "budget=64", "ratio=null",
                                   "batch_size=1", "generation.do_sample=true", "generation.top_k=5",
                                   "method.window=8"]
    run = spec.validate()
    assert run.choices == {"method": "snapkv", "dataset": "niah", "model": "tiny_llama"}
    assert run.method.window == 8 and run.cfg.budget == 64 and "hydra" not in run.cfg
    assert run.sampling().do_sample and run.sampling().top_k == 5
    assert RunSpec(method="full", model="tiny_llama").validate().budget_for(500) is None  # full: budget-free


@pytest.mark.parametrize("spec, message", [
    (RunSpec(method="snapk"), "Unknown method 'snapk'. Did you mean: snapkv? Available: "),
    (RunSpec(dataset="nia"), "Unknown dataset 'nia'. Did you mean: niah?"),
    (RunSpec(method="snapkv", budget=16, model="tiny_llama"), "snapkv: window=32 must be < budget=16"),
    (RunSpec(method="snapkv", model="tiny_llama", overrides=("method.windw=8",)), "has no field 'windw'. Did you mean: window?"),
    (RunSpec(model="tiny_llama", generation={"num_beams": 2}, batch_size=2), "beam search"),
])
def test_bad_input_is_one_line_before_weights_load(spec, message):
    with pytest.raises(ValueError) as e:
        spec.validate()
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.fixture(scope="module")
def engine():
    with Engine(RunSpec(method="snapkv", budget=48, model="tiny_llama", batch_size=2)) as engine:
        yield engine


def test_prompts_generated_together_equal_each_alone(engine):
    prompts = [list(range(5, 105)), list(range(7, 67)), "a short text prompt"]
    outs = engine.generate(prompts, max_new_tokens=5)
    assert [o.prompt_len for o in outs] == [100, 60, len(engine.tokenizer("a short text prompt").input_ids)]
    assert [o.kv_bytes for o in outs] == [48 * ENTRY, 48 * ENTRY, outs[2].prompt_len * ENTRY]  # kept entries x 512
    assert [o.full_kv_bytes for o in outs] == [o.prompt_len * ENTRY for o in outs]
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([engine.encode(prompt)])
        alone = generate(engine.model, engine.tokenizer, engine.run.method, engine.capture, ids, 48, 5)
        assert (alone.token_ids, alone.text, alone.kv_bytes_final) == (out.token_ids, out.text, out.kv_bytes_final)


def test_a_failing_prompt_raises_after_the_others(engine):
    with pytest.raises(Exception):
        engine.generate([list(range(5, 105)), []], max_new_tokens=3)  # an empty prompt cannot be prefilled
    assert len(engine.generate([list(range(5, 40))], max_new_tokens=2)[0].token_ids) == 2  # the engine goes on
