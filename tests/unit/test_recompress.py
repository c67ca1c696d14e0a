"""Compression while decoding (`decode_compression.every=N .target=T`, kvbench/engine/recompress.py): the cache's
bound over a long generation, the kept sets at each compression point against an independent recomputation, and
the full cache's tokens when the target holds everything."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kvbench.methods  # noqa: F401
from kvbench.engine.batching import Request, generate, generate_batched
from kvbench.engine.recompress import DecodeCompression, check
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from tests.unit.tiny import prompt, tiny_model

N_PROMPT, NEW, EVERY, TARGET = 60, 70, 16, 40
SCORERS = {"snapkv": {"window": 8}, "pyramidkv": {"window": 8}, "streamingllm": {}, "knorm": {},
           "expected_attention": {}}


def decode(model, name: str, budget: int | None, setting: DecodeCompression, new: int = NEW, seen=None, **kwargs):
    """One generation; `seen(t, cache)` looks at the cache before each step's forward."""
    method = METHODS[name](**{**SCORERS.get(name, {}), **kwargs})
    with AttentionCapture(model, window=method.query_window) as capture:
        watch = (lambda t, logits: seen(t, capture.cache)) if seen is not None else None
        return generate(model, None, method, capture, prompt(N_PROMPT), budget, new, on_logits=watch,
                        recompress=setting, eos_ids=set())  # (a random model's EOS would end it early)


@pytest.mark.parametrize("name", sorted(SCORERS))
def test_a_layer_never_holds_more_than_target_plus_interval(name):
    """Checked before every step's forward. PyramidKV's target is a mean over layers (its pyramid gives the lower
    layers more, and its shape changes with the length): the mean holds the bound; every other layer holds it."""
    model, means, longest = tiny_model("llama"), [], []

    def seen(t, cache):
        lengths = [layer.keys.shape[-2] for layer in cache.layers]
        means.append(sum(lengths) / len(lengths))
        longest.append(max(lengths))

    gen = decode(model, name, 32, DecodeCompression(EVERY, TARGET), seen=seen)
    assert len(gen.token_ids) == NEW
    assert max(means) <= TARGET + EVERY and max(means) > TARGET  # it grew past the target, and came back
    if name != "pyramidkv":
        assert max(longest) <= TARGET + EVERY


def test_streamingllm_keeps_the_sinks_and_the_newest_after_each_compression():
    """Hand-worked: 60 prompt tokens kept whole (budget 64); the k-th compression runs at decode step 16k, after
    that step's token (position 59 + 16k) is in; it keeps positions 0-3 and the newest 36."""
    model, kept = tiny_model("llama"), {}

    def seen(t, cache):
        kept[t] = cache.layers[0].positions[0, 0].tolist()

    decode(model, "streamingllm", 64, DecodeCompression(EVERY, TARGET), seen=seen)
    for t, positions in kept.items():
        steps = t  # decode forwards before choosing the (t+1)-th token (the first comes from the prefill's logits)
        if steps < EVERY:
            assert positions == list(range(N_PROMPT + steps))
            continue
        last = N_PROMPT - 1 + steps  # the newest position held
        since = steps % EVERY  # tokens appended since the last compression
        newest = list(range(last - since - (TARGET - 4) + 1, last + 1))
        assert positions == [0, 1, 2, 3] + newest, t


def test_snapkv_keeps_what_an_independent_recomputation_of_its_scores_keeps():
    """At every compression point, the kept entries are the top (target - window) by the window's pooled attention
    (softmax over the layer's keys, fp32, summed over the last `window` generated queries, averaged over each KV
    group's query heads, max-pooled by 7), plus the window: recomputed here from the layer's keys and the queries
    the model produced, as the SnapKV paper writes it. Ties aside: the kept scores' multiset is compared."""
    model = tiny_model("llama")
    method = METHODS["snapkv"](window=8)
    calls = []
    real_select = type(method).select

    def recording_select(self, view, n_keep):
        idx = real_select(self, view, n_keep)
        calls.append((view.keys.clone(), view.window_queries.clone(), view.scaling, n_keep, idx.clone()))
        return idx

    type(method).select = recording_select
    try:
        with AttentionCapture(model, window=8) as capture:
            generate(model, None, method, capture, prompt(N_PROMPT), 32, NEW, eos_ids=set(),
                     recompress=DecodeCompression(EVERY, TARGET))
    finally:
        type(method).select = real_select
    decode_calls = [c for c in calls if c[1].shape[2] == 8 and c[0].shape[-2] > 32]  # (not the prefill's)
    assert len(decode_calls) >= 4 * model.config.num_hidden_layers
    for keys, queries, scaling, n_keep, idx in decode_calls:
        b, h_kv, n, d = keys.shape
        h_q = queries.shape[1]
        k = keys.repeat_interleave(h_q // h_kv, dim=1).double()
        logits = queries.double() @ k.transpose(-1, -2) * scaling  # [1, H_q, 8, n]
        causal = torch.ones(8, 8, dtype=torch.bool).triu(1)
        logits[..., n - 8:] = logits[..., n - 8:].masked_fill(causal, float("-inf"))
        score = logits.softmax(-1)[..., : n - 8].sum(2).view(b, h_kv, h_q // h_kv, n - 8).mean(2)
        pooled = F.max_pool1d(score.view(b * h_kv, 1, -1), 7, 1, 3).view(b, h_kv, -1)
        assert idx.shape == (1, h_kv, n_keep) and idx[..., -8:].eq(torch.arange(n - 8, n)).all()
        chosen = pooled.gather(-1, idx[..., :-8]).sort(-1).values
        best = pooled.topk(n_keep - 8, -1).values.sort(-1).values
        torch.testing.assert_close(chosen, best, rtol=1e-6, atol=1e-9)


def test_a_target_that_holds_everything_gives_the_full_caches_tokens():
    model = tiny_model("llama")
    full = decode(model, "full", None, DecodeCompression(), new=40)
    for name in ("snapkv", "streamingllm"):
        gen = decode(model, name, N_PROMPT + 8, DecodeCompression(8, N_PROMPT + 40), new=40)
        assert gen.token_ids == full.token_ids and gen.kv_bytes_decode_peak == full.kv_bytes_decode_peak


def test_a_batch_equals_each_sample_alone():
    model, method = tiny_model("llama"), METHODS["pyramidkv"](window=8)
    setting = DecodeCompression(EVERY, TARGET)
    requests = [Request(prompt(n, seed=n), 32, new, ()) for n, new in [(N_PROMPT, 50), (N_PROMPT + 20, 66)]]
    with AttentionCapture(model, window=8) as capture:
        together = {r.max_new_tokens: g for r, g in generate_batched(model, None, method, capture, requests, 2,
                                                                     eos_ids=set(), recompress=setting)}
        alone = {r.max_new_tokens: g for r in requests for _, g in generate_batched(
            model, None, method, capture, [Request(r.input_ids, 32, r.max_new_tokens, ())], 1, eos_ids=set(),
            recompress=setting)}
    for new in together:
        assert together[new].token_ids == alone[new].token_ids
        assert together[new].kv_bytes_decode_peak == alone[new].kv_bytes_decode_peak


@pytest.mark.parametrize("name,why", [("full", "keeps every entry"), ("h2o", "evicts at every decode step"),
                                      ("adakv", "per-head variable"), ("tailorkv", "per-head variable or offloaded")])
def test_methods_that_cannot_compress_while_decoding_are_refused_in_one_line(name, why):
    with pytest.raises(ValueError, match=why) as refused:
        check(METHODS[name](), DecodeCompression(EVERY, TARGET))
    assert "\n" not in str(refused.value)


def test_the_command_compresses_while_decoding_in_a_batch_and_under_the_grid_launcher(tmp_path):
    """The switch end to end: batch_size=2 (basic launcher, in this process) and the grid launcher (a process)
    write the same records, and every record's decode-time peak holds target + every entries per head."""
    import subprocess
    import sys

    from tests.unit.test_cli import ENV, ROOT, records, run_dirs, run_here

    args = ["model=tiny_llama", "method.window=8", "budget=40", "dataset.context_lengths=[300]",
            "dataset.depth_percents=[0,100]", "dataset.metrics=[pyramidkv_recall]", "dataset.max_new_tokens=40",
            "decode_compression.target=40", "decode_compression.every=8", "report=false"]
    basic = {m: run_here(*args, f"method={m}", "batch_size=2", results=tmp_path / "basic")
             for m in ("snapkv", "pyramidkv")}
    out = subprocess.run([sys.executable, "-m", "kvbench.run", "-m", "hydra/launcher=grid", "method=snapkv,pyramidkv",
                          *args, f"results_dir={tmp_path / 'grid'}"], cwd=ROOT, env=ENV, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    volatile = {"prefill_s", "compress_s", "decode_s", "decode_tok_s", "e2e_s", "peak_mem_bytes", "peak_kv_bytes",
                "prefill_shared_by"}
    for method, run_dir in basic.items():
        (grid_dir,) = [d for d in run_dirs(tmp_path / "grid") if d.parent.name == method]
        assert grid_dir.name == run_dir.name  # the switch is part of the run's identity, the same in both
        mine, theirs = ({r["id"]: {k: v for k, v in r.items() if k not in volatile} for r in records(d)}
                        for d in (run_dir, grid_dir))
        assert mine == theirs and len(mine) == 2
        for r in records(run_dir):
            per_entry = r["kv_bytes"] / r["effective_budget"]  # bytes of one entry in every head and layer
            assert r["kv_bytes_peak"] <= per_entry * (40 + 8) + 1e-6
            assert r["new_tokens"] == 40 or r["stop_reason"] != "max_new_tokens"


def test_in_a_batch_uniform_layers_decode_in_rows_of_a_fixed_capacity_compacted_in_place():
    """SnapKV in a batch of two: its layers sit in shared rows sized once for target + every (rounded up to 64), not
    for prompt + every new token; they are compacted in place, and the tokens equal each sample alone."""
    from kvbench.cache.rows import RowLayer
    from kvbench.engine.batching import BatchedDecoder

    model, method = tiny_model("llama"), METHODS["snapkv"](window=8)
    setting = DecodeCompression(EVERY, TARGET)
    capacities, held = set(), []

    def watch(t, logits):
        capacities.update(rows.capacity for rows in decoder.rows.values())
        layers = [layer for slot_cache in caches for layer in slot_cache.layers if isinstance(layer, RowLayer)]
        held.append(max((layer.keys.shape[-2] for layer in layers), default=0))

    caches = []
    requests = [Request(prompt(n, seed=n), 32, 60, (), on_logits=watch) for n in (N_PROMPT, N_PROMPT + 20)]
    with AttentionCapture(model, window=8) as capture:
        decoder = BatchedDecoder(model, None, method, capture, 2, eos_ids=set(), recompress=setting)
        original_join = decoder._join
        decoder._join = lambda request: (slot := original_join(request), caches.append(slot.run.cache))[0]
        together = {r.input_ids.shape[1]: g for r, g in decoder.run(requests)}
        alone = {r.input_ids.shape[1]: g for r in requests for _, g in generate_batched(
            model, None, method, capture, [Request(r.input_ids, 32, 60, ())], 1, eos_ids=set(), recompress=setting)}
    assert capacities == {64}  # 40 + 16 entries, rounded up: not 32 + 60
    assert 0 < max(held) <= TARGET + EVERY
    for n in together:
        assert together[n].token_ids == alone[n].token_ids


def test_a_long_generation_holds_its_memory_bound_whatever_its_length():
    """600 tokens after a 60-token prompt (10x the prompt; the bound does not move with the length): before each
    step the cache holds at most target + every - 1 entries per head (the step's token makes it target + every,
    and the layer is compressed right after its attention), and so does the decode-time peak, sampled once every
    layer holds the step's token; the full cache grows to the whole sequence."""
    model, longest = tiny_model("llama", layers=2), []
    gen = decode(model, "streamingllm", 32, DecodeCompression(32, 48), new=600,
                 seen=lambda t, cache: longest.append(max(layer.keys.shape[-2] for layer in cache.layers)))
    full = decode(model, "full", None, DecodeCompression(), new=600)
    per_entry = full.kv_bytes / N_PROMPT
    assert len(gen.token_ids) == 600 and max(longest) == 48 + 32 - 1
    assert gen.kv_bytes_decode_peak == per_entry * (48 + 32 - 1)
    assert full.kv_bytes_decode_peak == per_entry * (N_PROMPT + 600 - 1)


@pytest.mark.parametrize("lazy", [True, False])
def test_simlayerkv_in_a_batch_holds_its_own_bound(lazy):
    """Hand-worked, target 48, every 16, budget 32: a lazy layer keeps 4 sinks + 32 - 1 prompt entries (35), is not
    cut at step 16 (35 + 16 = 51 = its share 4 + 48 - 1), and is cut from 67 back to 51 at steps 32 and 48, so it
    peaks at 4 + 48 - 1 + 16 - 1 = 66 entries after a step (not the other methods' target + every - 1); a layer
    never lazy (threshold 1) keeps everything, prompt + 59 decoded tokens. In a batch of two (main sized the rows for the
    target + every and the rows ran full) each sample equals itself alone."""
    model, method = tiny_model("llama"), METHODS["simlayerkv"](lazy_threshold=0.0 if lazy else 1.0)
    setting = DecodeCompression(EVERY, 48)
    requests = [Request(prompt(n, seed=n), 32, 60, ()) for n in (N_PROMPT, N_PROMPT + 20)]
    with AttentionCapture(model, window=method.query_window) as capture:
        together = dict(generate_batched(model, None, method, capture, requests, 2, eos_ids=set(), recompress=setting))
        alone = [g for r in requests for _, g in generate_batched(model, None, method, capture, [r], 1, eos_ids=set(),
                                                                    recompress=setting)]
    for request, single in zip(requests, alone):
        gen, n = together[request], request.input_ids.shape[1]
        assert not isinstance(gen, Exception), gen
        assert gen.token_ids == single.token_ids and gen.kv_bytes_decode_peak == single.kv_bytes_decode_peak
        per_entry = gen.full_kv_bytes / n  # one entry in every head and layer
        assert gen.kv_bytes_decode_peak == per_entry * (4 + 48 - 1 + EVERY - 1 if lazy else n + 60 - 1)
