"""Batched decoding (kvbench.engine.batching) against batch 1 (kvbench.engine.generation.generate), the independent reference:
same tokens, text and cache accounting per sample, for prompts of different lengths, one-shot, per-head variable
(Ada-KV) and decode-time (H2O, Keyformer, BUZZ) methods, with samples leaving and joining the batch."""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

import kvbench.methods  # noqa: F401
from kvbench.engine.batching import Decoding, PrefilledOnce, Request, generate_batched
from kvbench.engine.generation import Sampling
from kvbench.engine.batching import generate
from kvbench.models import AttentionCapture
from kvbench.models.adapters import BY_FAMILY
from kvbench.models.loader import RANDOM_FAMILIES
from kvbench.models.tiny import tiny_random_model
from kvbench.registry import METHODS
from tests.unit.test_contract import configured
from tests.unit.tiny import prompt, tiny_model

LENGTHS = [150, 70, 210, 120, 95]  # different prompt lengths: caches differ per sample, layer and head
NEW = [12, 4, 9, 12, 1]  # different generation lengths: samples leave and others join
FIELDS = ("token_ids", "text", "prompt_len", "kv_bytes", "full_kv_bytes", "kv_bytes_final", "kept_per_head",
          "kv_bytes_per_layer", "kv_bytes_per_layer_final", "host_kv_bytes", "transfers")


def batch_one_and_batched(model, method, budget, batch_size, sampling=Sampling(), positions="original",
                          eos_ids=frozenset(), stop=(), tokenizer=None, min_new_tokens=0):
    """Each prompt through `generate` alone, then all through `generate_batched`; both lists in request order."""
    prompts = [prompt(n, seed=i) for i, n in enumerate(LENGTHS)]
    window = method.query_window
    with AttentionCapture(model, window=window) as capture:
        alone = [generate(model, tokenizer, method, capture, ids, budget, new, stop, sampling, set(eos_ids),
                          positions=positions, seed=100 + i, min_new_tokens=min_new_tokens)
                 for i, (ids, new) in enumerate(zip(prompts, NEW))]
        requests = [Request(ids, budget, new, stop, (), min_new_tokens, 100 + i, tag=i)
                    for i, (ids, new) in enumerate(zip(prompts, NEW))]
        done = {r.tag: g for r, g in generate_batched(model, tokenizer, method, capture, requests, batch_size,
                                                      sampling, positions, set(eos_ids))}
    return alone, [done[i] for i in range(len(prompts))]


def assert_same(alone, batched):
    for one, many in zip(alone, batched):
        for name in FIELDS:
            assert getattr(many, name) == getattr(one, name), name


@pytest.mark.parametrize("name", METHODS.names())
def test_batch_n_equals_batch_1(name):
    model = tiny_model("llama", layers=2)
    method = configured(name)
    budget = None if name == "full" else 48
    alone, batched = batch_one_and_batched(model, method, budget, batch_size=3)
    assert_same(alone, batched)
    assert [len(g.token_ids) for g in batched] == NEW


def mixed_lengths(count: int) -> tuple[list[int], list[int]]:
    """Prompt and generation lengths for a batch of `count` samples, as many as the registry needs: prompts >= 10
    apart (so a decoded row's position says whose it is) in no order, generations of 2 to 8 tokens (samples leave
    and others join)."""
    first = [150, 70, 210, 120, 95, 180, 60, 130, 200, 110, 85, 160, 140, 225, 240, 255, 270, 285, 300]
    lengths = (first + [300 + 15 * k for k in range(1, count - len(first) + 1)])[:count]
    return lengths, [(6, 3, 8, 5, 2, 7, 4)[i % 7] for i in range(count)]


def test_lengths_grow_with_the_registry():
    for count in (5, 19, 20, 40):
        lengths, new = mixed_lengths(count)
        assert len(lengths) == len(new) == count and min(new) >= 2 and max(new) <= 8
        ordered = sorted(lengths)
        assert all(b - a >= 10 for a, b in zip(ordered, ordered[1:])) and ordered[0] > 48  # above the budget


@pytest.mark.registry
def test_a_batch_mixing_every_method_equals_each_alone(monkeypatch):
    """Every registered method (and BUZZ with its log n temperature) in one batch, with joins and departures: shared
    rows for the plain layers, one engine attention call for the per-head, quantized, offloaded and evicting ones.
    Each sample's records, its logits at every step and its evictor's accumulated scores equal its own batch-1 run.
    Queries are scaled up so that attention logits reach a few units (a random tiny model's stay near 0.1) and what
    attention does shows."""
    from kvbench.methods.decoding import EvictionState

    apply = EvictionState._apply
    scores: dict[str, dict[tuple, torch.Tensor]] = {"alone": {}, "batched": {}}
    run = ["alone"]

    def recorded(state, layer_idx, layer, idx):  # the scores each eviction chose from, by sample, step and layer
        scores[run[0]][state.prompt_len, state.step, layer_idx] = state.scores[layer_idx].clone()
        apply(state, layer_idx, layer, idx)

    monkeypatch.setattr(EvictionState, "_apply", recorded)
    model = tiny_model("llama", layers=2)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight *= 30
    methods = [configured(name) for name in METHODS.names()] + [METHODS["buzz"](logn=True)]
    lengths, new = mixed_lengths(len(methods))
    prompts = [prompt(n, seed=i) for i, n in enumerate(lengths)]
    budget = [None if m.registry_name == "full" else 48 for m in methods]
    seen: dict[str, dict[int, torch.Tensor]] = {"alone": {}, "batched": {}}
    record = {}

    def by_position(module, args, kwargs, output):  # a row's position says whose it is (prompts >= 10 apart)
        if kwargs["position_ids"].shape[1] > 1 and kwargs["position_ids"][0, 0] > 0:
            return  # KVzip's reconstruction prefills (after a context, scored, then dropped) would collide
        for row, position in enumerate(kwargs["position_ids"][:, -1].tolist()):
            record[position] = output.logits[row, -1].clone()

    handle = model.register_forward_hook(by_position, with_kwargs=True)
    try:
        with AttentionCapture(model) as capture:
            record = seen["alone"]
            alone = [generate(model, None, m, capture, ids, b, n, eos_ids=set(), seed=100 + i)
                     for i, (m, ids, b, n) in enumerate(zip(methods, prompts, budget, new))]
            record, run[0] = seen["batched"], "batched"
            requests = [Request(ids, b, n, seed=100 + i, tag=i, decoding=Decoding(m))
                        for i, (m, ids, b, n) in enumerate(zip(methods, prompts, budget, new))]
            done = {r.tag: g for r, g in generate_batched(model, None, METHODS["full"](), capture, requests, 6,
                                                          eos_ids=set())}
    finally:
        handle.remove()
    assert_same(alone, [done[i] for i in range(len(methods))])
    assert [len(done[i].token_ids) for i in range(len(methods))] == new
    assert seen["batched"].keys() == seen["alone"].keys()
    for position, logits in seen["alone"].items():
        torch.testing.assert_close(seen["batched"][position], logits, rtol=1e-5, atol=1e-5)
    assert scores["batched"].keys() == scores["alone"].keys() and len(scores["alone"]) > 50
    for key, expected in scores["alone"].items():
        torch.testing.assert_close(scores["batched"][key], expected, rtol=1e-5, atol=1e-6)


def test_copied_slots_decode_with_their_own_hooks_at_batch_1():
    """PrefilledOnce (scripts/bench_batch.py) decodes copies of compressed caches: at batch 1 each copy's
    decode-time evictor must act on that copy, not on the last prepared sample's cache."""
    model, method = tiny_model(), METHODS["h2o"]()
    prompts = [prompt(n, seed=i) for i, n in enumerate(LENGTHS[:3])]
    with AttentionCapture(model) as capture:
        alone = [generate(model, None, method, capture, ids, 16, 8, eos_ids=set(), seed=i).token_ids
                 for i, ids in enumerate(prompts)]
        memo, got = {}, {}
        for batch in (2, 1):
            decoder = PrefilledOnce(model, None, method, capture, batch, eos_ids=set(), memo=memo)
            done = {r.tag: g for r, g in decoder.run([Request(ids, 16, 8, seed=i, tag=i)
                                                      for i, ids in enumerate(prompts)])}
            got[batch] = [done[i].token_ids for i in range(len(prompts))]
    assert got[1] == got[2] == alone


def test_gqa_family_with_shift_positions_and_prefill_only_h2o():
    model = tiny_model("qwen2", layers=2)
    for method, positions in [(METHODS["h2o"](), "shift"), (METHODS["h2o"](variant="prefill_only"), "original"),
                              (METHODS["streamingllm"](), "shift")]:
        assert_same(*batch_one_and_batched(model, method, 40, batch_size=4, positions=positions))


def test_a_uniform_sliding_window_is_applied_per_sample():
    """Mistral v0.1 / Phi-3-mini: one window over every layer, applied by each kept key's original position. Prompts
    and budgets reach past the window, so a mask built for one sample and used for all would change the tokens."""
    model = tiny_model("mistral", layers=2)
    model.config.sliding_window = 32
    for name in ("snapkv", "full"):
        method = configured(name)
        assert_same(*batch_one_and_batched(model, method, None if name == "full" else 64, batch_size=3))


def test_sampling_eos_and_min_new_tokens_follow_batch_1():
    model = tiny_model("mistral", layers=2)
    sampling = Sampling(do_sample=True, temperature=1.5, top_k=20, seed=3)
    greedy_alone, _ = batch_one_and_batched(model, METHODS["snapkv"](window=8), 48, batch_size=1)
    eos = {greedy_alone[0].token_ids[2], greedy_alone[3].token_ids[5]}  # tokens that do come up: samples stop early
    lengths = []
    for kwargs in ({"sampling": sampling}, {"eos_ids": eos}, {"eos_ids": eos, "min_new_tokens": 4}):
        alone, batched = batch_one_and_batched(model, METHODS["snapkv"](window=8), 48, batch_size=2, **kwargs)
        assert_same(alone, batched)
        lengths.append(len(batched[0].token_ids))
    assert lengths[1] == 2 < lengths[2]  # EOS really ended a sample early, and not before min_new_tokens


def test_finished_samples_leave_and_new_ones_join():
    """Forward batch sizes, step by step: never above batch_size, and a slot freed by a short sample is refilled."""
    model, method = tiny_model("llama", layers=2), METHODS["snapkv"](window=8)
    requests = [Request(prompt(n, seed=i), 48, new, tag=i) for i, (n, new) in enumerate(zip(LENGTHS, NEW))]
    sizes = []
    handle = model.register_forward_pre_hook(lambda m, args, kw: sizes.append(kw["input_ids"].shape),
                                             with_kwargs=True)
    with AttentionCapture(model, window=8) as capture:
        order = [r.tag for r, _ in generate_batched(model, None, method, capture, requests, 2, eos_ids=set())]
    handle.remove()
    decode = [s[0] for s in sizes if s[1] == 1]
    assert max(decode) == 2 and sum(decode) == sum(n - 1 for n in NEW)  # every decode forward, none wasted
    assert len(decode) < sum(n - 1 for n in NEW)  # and they were shared
    assert order == [1, 0, 2, 4, 3]  # the short sample 1 left first; 2 took its slot before 0 finished


def test_a_sample_that_fails_fails_alone(tmp_path):
    """A sample whose compression raises (CUDA out of memory, once) comes back as its exception; the others decode
    as they do alone."""
    from tests.unit.faulty import OutOfMemorySnapKV

    model = tiny_model("llama", layers=2)
    alone, _ = batch_one_and_batched(model, METHODS["snapkv"](window=8), 48, batch_size=1)
    (tmp_path / "oom").touch()
    method = OutOfMemorySnapKV(window=8, oom_flag=str(tmp_path / "oom"))
    requests = [Request(prompt(n, seed=i), 48, new, seed=100 + i, tag=i)
                for i, (n, new) in enumerate(zip(LENGTHS, NEW))]
    with AttentionCapture(model) as capture:
        done = dict((r.tag, g) for r, g in generate_batched(model, None, method, capture, requests, 3, eos_ids=set()))
    assert isinstance(done.pop(0), torch.cuda.OutOfMemoryError)
    assert_same([alone[i] for i in sorted(done)], [done[i] for i in sorted(done)])


def test_a_failing_step_fails_the_samples_in_it_and_no_others():
    """A decode step that raises inside the batched forward fails the samples of that step (it cannot tell whose
    it was); the samples that joined later decode as they do alone."""
    from tests.unit.faulty import StepFailingH2O

    model = tiny_model("llama", layers=2)
    alone, _ = batch_one_and_batched(model, METHODS["h2o"](), 48, batch_size=1)
    method = StepFailingH2O(fail_prompt_len=LENGTHS[0])
    requests = [Request(prompt(n, seed=i), 48, new, seed=100 + i, tag=i)
                for i, (n, new) in enumerate(zip(LENGTHS, NEW))]
    with AttentionCapture(model) as capture:
        done = dict((r.tag, g) for r, g in generate_batched(model, None, method, capture, requests, 2, eos_ids=set()))
    failed = sorted(i for i, g in done.items() if isinstance(g, Exception))
    assert failed == [0, 1]  # sample 0's third step was sample 1's third (and last) one too
    assert_same(alone[2:], [done[i] for i in range(2, len(LENGTHS))])


def test_cli_batch_size_gives_the_same_records(tmp_path):
    """The command at batch_size=1 and 3, each as `python -m kvbench.run` runs it once its checks pass, in this
    process (run_here; results_dir per batch size, as batch_size does not change the run's identity): the same
    records, timings aside."""
    from tests.unit.test_cli import GRID, records, run_dirs, run_here

    timing = ("prefill_s", "compress_s", "decode_s", "decode_tok_s", "e2e_s", "peak_mem_bytes")
    runs = {}
    for batch_size in (1, 3):
        run_dir = run_here("model=tiny_llama", "method=h2o", "budget=64", *GRID, "report=false",
                           f"batch_size={batch_size}", results=tmp_path / f"b{batch_size}")
        assert run_dirs(tmp_path / f"b{batch_size}") == [run_dir]
        runs[batch_size] = {r["id"]: {k: v for k, v in r.items() if k not in timing} for r in records(run_dir)}
        assert OmegaConf.load(run_dir / "config.yaml").batch_size == batch_size
    assert runs[3] == runs[1] and len(runs[1]) == 4


def test_bad_batch_size_is_refused():
    with pytest.raises(ValueError, match="batch_size=0"):
        list(generate_batched(tiny_model("llama", layers=1), None, METHODS["full"](), None,
                              [Request(prompt(10), None, 2)], 0))


@pytest.mark.parametrize("family", RANDOM_FAMILIES)
def test_every_family_batches_or_refuses_in_one_line(family):
    """Families whose attention goes through transformers' interface batch exactly (learned positions, fused QKV,
    query norms included); those with their own attention forward or sliding-window layers are refused."""
    model = tiny_random_model(family)
    adapter = BY_FAMILY[family]
    if adapter.replaces is not None or adapter.has_window_layers:
        with AttentionCapture(model) as capture, pytest.raises(ValueError, match="batch_size=1 only"):
            list(generate_batched(model, None, METHODS["full"](), capture, [Request(prompt(10), None, 2)], 2))
        return
    for name in ("snapkv", "h2o"):
        assert_same(*batch_one_and_batched(model, configured(name), 48, batch_size=3))


def test_teacher_forced_streams_of_different_lengths_keep_their_own_tokens_in_one_batch():
    """A stream that has fed all its tokens ends (its token rule returns None) in the same step as another goes on:
    each stream still records exactly its own forced tokens, and its logits equal the same stream fed alone."""
    from kvbench.engine.batching import BatchedDecoder

    model, streams = tiny_model(), [[5, 6], [7, 8, 9, 10, 11]]
    ids = [prompt(40, seed=1), prompt(55, seed=2)]

    def run(batch_size, members):
        seen = {i: [] for i in members}
        requests = [Request(ids[i], None, len(streams[i]) + 1, tag=i, forced=list(streams[i]),
                            on_logits=lambda t, logits, i=i: seen[i].append(logits.clone())) for i in members]
        with AttentionCapture(model) as capture:
            decoder = BatchedDecoder(model, None, METHODS["full"](), capture, batch_size, eos_ids=set())
            done = {r.tag: g for r, g in decoder.run(requests)}
        return done, seen

    together, seen = run(2, [0, 1])
    for i in (0, 1):
        alone, seen_alone = run(1, [i])
        assert together[i].token_ids == streams[i] == alone[i].token_ids
        assert len(seen[i]) == len(streams[i]) + 1
        for a, b in zip(seen[i], seen_alone[i]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_samples_of_one_method_share_tailorkv_and_h2o_work_and_equal_batch_1(monkeypatch):
    """Two TailorKV and two H2O samples in one batch: TailorKV's predicted query is one projection per layer over
    both rows, its top-k retrieval one call, and H2O's scores and eviction one call for both (one budget); each
    sample's tokens and records still equal its own batch-1 run."""
    from kvbench.cache.offloaded import OffloadedLayer
    from kvbench.methods.h2o import H2O

    model = tiny_model("llama", layers=3)
    tailorkv, h2o = configured("tailorkv"), configured("h2o")
    methods = [tailorkv, h2o, tailorkv, h2o]
    prompts = [prompt(n, seed=i) for i, n in enumerate([150, 120, 210, 95])]
    rows = {"query": [], "retrieval": [], "evict": []}
    with AttentionCapture(model) as capture:
        alone = [generate(model, None, m, capture, ids, 48, 5, eos_ids=set(), seed=i)
                 for i, (m, ids) in enumerate(zip(methods, prompts))]
        predict, many, evict = capture.predict_query, OffloadedLayer.decode_kv_many, H2O.evict
        monkeypatch.setattr(capture, "predict_query",
                            lambda i, hidden, pos: rows["query"].append(len(hidden)) or predict(i, hidden, pos))
        monkeypatch.setattr(OffloadedLayer, "decode_kv_many",
                            staticmethod(lambda layers, q: rows["retrieval"].append(len(layers)) or many(layers, q)))
        monkeypatch.setattr(H2O, "evict", lambda self, state, i, scores, prefill: rows["evict"].append(
            0 if prefill else len(scores)) or evict(self, state, i, scores, prefill))
        requests = [Request(ids, 48, 5, seed=i, tag=i, decoding=Decoding(m))
                    for i, (m, ids) in enumerate(zip(methods, prompts))]
        done = {r.tag: g for r, g in generate_batched(model, None, tailorkv, capture, requests, 4, eos_ids=set())}
    assert_same(alone, [done[i] for i in range(4)])
    # 4 decode steps: layers 1 and 2 offloaded (layer 0 quantized), both predicted; H2O: 2 samples x 3 layers at
    # prefill, then every step and layer one call for both
    assert rows["query"] == [2] * 8 and rows["retrieval"] == [2] * 8
    assert rows["evict"] == [0] * 6 + [2] * 12
