"""`BatchedDecoder.joins_per_step` (the server sets 1): at most that many requests join, each prefilled, between two
batched steps, so a burst's first request gets its first token before the next prefill instead of after all of
them. The generations stay batch 1's; a request that fails to join does not stop the ones behind it."""
from __future__ import annotations

import torch

import kvbench.methods  # noqa: F401
from kvbench.engine.batching import BatchedDecoder, Request
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from tests.unit.test_batching import LENGTHS, NEW, assert_same, batch_one_and_batched
from tests.unit.tiny import prompt, tiny_model


def requests() -> list[Request]:
    return [Request(prompt(n, seed=i), 48, new, seed=100 + i, tag=i) for i, (n, new) in enumerate(zip(LENGTHS, NEW))]


def test_one_join_per_step_interleaves_prefills_with_steps_and_keeps_the_generations():
    model = tiny_model("llama", layers=2)
    method = METHODS["snapkv"](window=8)
    alone, _ = batch_one_and_batched(model, method, 48, batch_size=1)
    joined_at, steps = {}, [0]
    with AttentionCapture(model) as capture:
        decoder = BatchedDecoder(model, None, method, capture, 3, eos_ids=set())
        decoder.joins_per_step = 1
        decoder.on_join = lambda slot: joined_at.setdefault(slot.request.tag, steps[0])
        decoder.on_step = lambda active: steps.__setitem__(0, steps[0] + 1)
        done = {r.tag: g for r, g in decoder.run(requests())}
    assert_same(alone, [done[i] for i in range(len(LENGTHS))])
    assert [joined_at[i] for i in range(3)] == [0, 1, 2]  # one prefill between two steps while the batch fills up


def test_a_request_that_fails_to_join_does_not_end_the_run(tmp_path):
    from tests.unit.faulty import OutOfMemorySnapKV

    model = tiny_model("llama", layers=2)
    alone, _ = batch_one_and_batched(model, METHODS["snapkv"](window=8), 48, batch_size=1)
    (tmp_path / "oom").touch()  # the first request's compression raises, once: nothing is active after it
    method = OutOfMemorySnapKV(window=8, oom_flag=str(tmp_path / "oom"))
    with AttentionCapture(model) as capture:
        decoder = BatchedDecoder(model, None, method, capture, 3, eos_ids=set())
        decoder.joins_per_step = 1
        done = {r.tag: g for r, g in decoder.run(requests())}
    assert isinstance(done.pop(0), torch.cuda.OutOfMemoryError)
    assert sorted(done) == [1, 2, 3, 4]
    assert_same([alone[i] for i in sorted(done)], [done[i] for i in sorted(done)])
