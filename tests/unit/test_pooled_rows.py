"""Per-sample work pooled across a batch: H2O's samples of one budget in shared evicting rows
(`kvbench.cache.evicting_rows`). Each sample's tokens, records, decode-time byte figures and H2O's accumulated scores
equal its own batch-1 run, with joins, departures and a prompt shorter than the budget (its layers evict alone);
conversations whose cache lives on after a turn leaves the batch: test_turns_batch.py's h2o conversations."""
from __future__ import annotations

import torch

import kvbench.methods  # noqa: F401
from kvbench.cache.evicting_rows import EvictingRows
from kvbench.engine.batching import BatchedDecoder, Decoding, Request, generate, generate_batched
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from tests.unit.test_batching import assert_same
from tests.unit.tiny import prompt, tiny_model

LENGTHS = [90, 40, 130, 70, 110]  # sample 1 is shorter than the budget: its layers grow, then evict alone
NEW = [6, 9, 3, 7, 5]
BUDGET = 48
DECODE_FIELDS = ("peak_kv_bytes", "kv_bytes_decode_peak", "kv_bytes_decode_mean", "stop_reason")


def test_h2o_samples_in_evicting_rows_equal_each_alone(monkeypatch):
    model = tiny_model("llama", layers=2)
    method = METHODS["h2o"]()
    prompts = [prompt(n, seed=i) for i, n in enumerate(LENGTHS)]
    kept, left = [], {"alone": {}, "batched": {}}
    keep_all, leave, phase = EvictingRows.keep_all, BatchedDecoder._leave_rows, ["alone"]

    def counted(rows, idx):
        kept.append(idx.shape[0])
        keep_all(rows, idx)

    def leaving(decoder, slot, keep=False):  # the scores each sample holds once it has left, by its prompt length
        leave(decoder, slot, keep)
        left[phase[0]][slot.run.prompt_len] = {i: s.clone() for i, s in slot.decode_hook.state.scores.items()}

    monkeypatch.setattr(EvictingRows, "keep_all", counted)
    monkeypatch.setattr(BatchedDecoder, "_leave_rows", leaving)
    with AttentionCapture(model) as capture:
        alone = [generate(model, None, method, capture, ids, BUDGET, new, eos_ids=set(), seed=i)
                 for i, (ids, new) in enumerate(zip(prompts, NEW))]
        phase[0] = "batched"
        requests = [Request(ids, BUDGET, new, seed=i, tag=i, decoding=Decoding(method))
                    for i, (ids, new) in enumerate(zip(prompts, NEW))]
        done = {r.tag: g for r, g in generate_batched(model, None, method, capture, requests, 3, eos_ids=set())}
    batched = [done[i] for i in range(len(prompts))]
    assert_same(alone, batched)
    for one, many in zip(alone, batched):
        assert [getattr(many, name) for name in DECODE_FIELDS] == [getattr(one, name) for name in DECODE_FIELDS]
    assert kept and max(kept) >= 2  # the rows evicted several samples in one call
    assert left["batched"].keys() == left["alone"].keys() and len(left["alone"]) == len(LENGTHS)
    for n, scores in left["alone"].items():
        assert left["batched"][n].keys() == scores.keys()
        for layer, expected in scores.items():
            torch.testing.assert_close(left["batched"][n][layer], expected, rtol=1e-5, atol=1e-6)
