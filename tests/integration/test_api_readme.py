"""The README's Python API example runs as written, on the embedded model: two prompts generated together, their KV
bytes counted by hand (SnapKV keeps 128 entries in each of SmolLM2's 30 layers x 3 KV heads x 64 dims, fp32), and
the same tokens as each prompt generated alone through the engine's batch of one."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from kvbench.engine.batching import generate

pytestmark = pytest.mark.slow
README = Path(__file__).resolve().parents[2] / "README.md"
ENTRY = 2 * 30 * 3 * 64 * 4  # one entry in every layer and KV head, keys and values, fp32


def readme_example() -> str:
    section = README.read_text().split("## Python API", 1)[1]
    return re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)


def test_the_readme_example_runs_and_reads_back_kv_bytes(capsys):
    code = readme_example()
    assert "Engine(run)" in code and "engine.generate(prompts" in code
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)  # noqa: S102 - the README's own code, as a user runs it
    outs, engine = scope["outs"], scope["engine"]
    assert len(outs) == 2 and len(capsys.readouterr().out.splitlines()) == 2
    for out in outs:
        assert out.prompt_len > 128 and out.kv_bytes == 128 * ENTRY and out.full_kv_bytes == out.prompt_len * ENTRY
        assert 0 < len(out.token_ids) <= 8
    from kvbench.models import AttentionCapture

    method = engine.run.method
    with AttentionCapture(engine.model, window=method.query_window) as capture:  # (the engine closed its own)
        for prompt, out in zip(scope["prompts"], outs):
            ids = torch.tensor([engine.encode(prompt)])
            alone = generate(engine.model, engine.tokenizer, method, capture, ids, 128, 8)
            assert alone.token_ids == out.token_ids and alone.kv_bytes == out.kv_bytes
