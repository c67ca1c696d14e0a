"""GPU tier: the static step recorded into a CUDA graph and replayed decodes what the same step decodes eagerly, per
method, in bf16, and neither the eager step nor a replay synchronizes with the host (`set_sync_debug_mode("error")`
raises on any sync inside them). Skipped without CUDA."""
from __future__ import annotations

import contextlib

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import kvbench.methods  # noqa: E402,F401
from kvbench.engine import static  # noqa: E402
from kvbench.engine.batching import Request  # noqa: E402
from kvbench.models import AttentionCapture  # noqa: E402
from tests.unit.test_compiled_step import CAPTURED, LENGTHS, NEW  # noqa: E402
from tests.unit.test_contract import configured  # noqa: E402
from tests.unit.tiny import prompt, tiny_model  # noqa: E402


@contextlib.contextmanager
def no_host_sync():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2).to("cuda", torch.bfloat16)


@pytest.mark.parametrize("name", [case for case in CAPTURED if " " not in case])
def test_the_captured_step_equals_the_eager_static_step_without_host_sync(model, name, monkeypatch):
    step, replay = static.StaticDecoder.step, static.GraphStep.__call__

    def checked_step(self, tokens):
        if torch.cuda.is_current_stream_capturing():
            return step(self, tokens)
        with no_host_sync():
            return step(self, tokens)

    def checked_replay(self, tokens):
        if self.graph is None:
            return replay(self, tokens)
        with no_host_sync():
            return replay(self, tokens)

    monkeypatch.setattr(static.StaticDecoder, "step", checked_step)
    monkeypatch.setattr(static.GraphStep, "__call__", checked_replay)
    method, budget = configured(name), None if name == "full" else 48
    outcomes = []
    for compile in (False, True):
        requests = [Request(prompt(n, seed=i).cuda(), budget, new, seed=100 + i, tag=i)
                    for i, (n, new) in enumerate(zip(LENGTHS, NEW))]
        with AttentionCapture(model, window=method.query_window) as capture:
            decoder = static.StaticDecoder(model, None, method, capture, 2, eos_ids=set(), compile=compile)
            outcomes.append({r.tag: g for r, g in decoder.run(requests)})
    eager, captured = outcomes
    for i in eager:
        assert not isinstance(captured[i], Exception), captured[i]
        assert captured[i].token_ids == eager[i].token_ids and captured[i].step == "captured"
        assert captured[i].kv_bytes_final == eager[i].kv_bytes_final
