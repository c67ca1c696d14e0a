"""The batched step routes attention per step (kvbench.engine.batching.use_attention): transformers'
`set_attn_implementation` walks every module, so a step whose attention is already the one set must not call it
(a batch of one steps on the capture's own function), and a batched step must still switch to its own function and
back, so that a request joining between steps prefills through the capture."""
from __future__ import annotations

import torch

from kvbench.runs.api import Engine, RunSpec

torch.set_num_threads(1)


def test_batch_one_never_switches_and_batches_switch_back():
    with Engine(RunSpec(method="snapkv", budget=24, model="tiny_llama", overrides=("method.window=8",))) as engine:
        model = engine.model
        captured = model.config._attn_implementation
        seen = []
        switch = model.set_attn_implementation

        def spy(name, *args, **kwargs):  # records, then does the real switch
            seen.append(name)
            return switch(name, *args, **kwargs)

        model.set_attn_implementation = spy
        prompts = [list(range(5, 45)), list(range(50, 95))]
        alone = engine.generate(prompts, max_new_tokens=5, batch_size=1, stop=())
        assert seen == []  # five steps per prompt, none of them walked the model
        together = engine.generate(prompts, max_new_tokens=5, batch_size=2)
        del model.set_attn_implementation
        assert seen and seen[0] != captured and seen[-1] == captured  # its own function, then the capture's again
        assert model.config._attn_implementation == captured
    assert [len(g.token_ids) for g in together + alone] == [5] * 4  # (batch 1 = batch N: tests/unit/test_batching.py)
