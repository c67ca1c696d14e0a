"""The load benchmark (kvbench.serving): the admission rule against hand-worked byte counts, first-come-first-served
admission under a pool, the pool never exceeded at any step of a real run of the tiny model (its caches' own
bytes), latencies in order, the same predictions as the engine without a pool, and resume."""
from __future__ import annotations

import json

import pytest
import torch

from kvbench.engine.batching import generate
from kvbench.runs.api import Engine, RunSpec
from kvbench.serving.__main__ import parse
from kvbench.serving.arrivals import Arrival, PoolSource
from kvbench.serving.bench import ServingSpec, check, run_dir_of, run_load
from kvbench.serving.figures import pareto_front
from kvbench.serving.pool import KVPool, KVShape, check_bounded, reserved_entries

torch.set_num_threads(1)
NIAH = ("dataset.context_lengths=[400]", "dataset.depth_percents=[0,25,50,75,100]", "dataset.max_new_tokens=6")
# tiny_llama: 2 layers x 2 KV heads x head_dim 16, fp32: one entry in every layer and head, keys and values
ENTRY = 2 * 2 * 2 * 16 * 4


def spec(method: str, budget: int | None = 64) -> RunSpec:
    return RunSpec(method=method, budget=budget, model="tiny_llama", overrides=NIAH)


@pytest.fixture(scope="module")
def loaded():
    """The tiny model and tokenizer, loaded once; each test's engine attaches its own method to them."""
    with Engine(spec("full")) as engine:
        yield engine.model, engine.tokenizer


def test_reservation_is_the_hand_worked_bound():
    full, snapkv, h2o = (spec(m).validate().method for m in ("full", "snapkv", "h2o"))
    assert reserved_entries(full, 100, None, 6) == 106
    assert reserved_entries(snapkv, 100, 48, 6) == 48 + 6  # the kept prompt, then every token it may decode
    assert reserved_entries(snapkv, 30, 48, 6) == 30 + 6  # a prompt under the budget keeps all of it
    assert reserved_entries(h2o, 100, 48, 6) == 48 + 1  # the evictor holds its budget and the token it scores
    assert reserved_entries(h2o, 20, 48, 6) == 26
    with pytest.raises(ValueError, match="tailorkv's KV bytes have no bound"):
        check_bounded(spec("tailorkv", 128).validate().method)


def test_reservation_bounds_what_the_real_cache_holds(loaded):
    with Engine(spec("snapkv", 48), loaded=loaded) as engine:
        assert KVShape.of(engine.model).entry_bytes == ENTRY
        gen = generate(engine.model, None, engine.run.method, engine.capture, torch.arange(5, 105)[None], 48, 6)
    assert (gen.full_kv_bytes, gen.kv_bytes) == (100 * ENTRY, 48 * ENTRY)  # counted by hand: entries x 512
    assert gen.peak_kv_bytes <= gen.full_kv_bytes and gen.kv_bytes_final == (48 + 6 - 1) * ENTRY  # (last not fed)
    assert gen.kv_bytes_final <= reserved_entries(engine.run.method, 100, 48, 6) * ENTRY


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_first_come_first_served_under_the_pool():
    r = [object() for _ in range(5)]  # requests are told apart by identity, as the engine's are
    clock = Clock()
    pool = KVPool(100)
    source = PoolSource(r, [60, 50, 30, 120, 40], pool, Arrival("burst"), clock=clock)
    assert source.poll([]) is r[0]
    assert source.poll([]) is None  # r1 (50) waits for 60 + 50 > 100; r2 (30) would fit but does not overtake
    clock.t = 2.0
    assert source.finished(r[0]).finish_s == 2.0 and pool.used_bytes == 0
    assert source.poll([]) is r[1] and source.poll([]) is r[2]  # 80 of 100
    assert source.poll([]) is None  # r3 (120 > 100) never fits: set aside; r4 (40) waits for room
    assert source.rejected == [r[3]] and pool.used_bytes == 80
    source.finished(r[1])
    assert source.poll([]) is r[4] and pool.used_bytes == 70 and pool.peak_bytes == 80
    assert source.of(r[4]).arrival_s == 0.0 and source.of(r[4]).admit_s == 2.0
    assert source.wait() is False  # every request came and none waits: the engine's loop may end


def test_closed_loop_and_poisson_arrivals():
    a, b, c = (object() for _ in range(3))
    clock = Clock()
    source = PoolSource([a, b, c], [1, 1, 1], KVPool(10), Arrival("concurrency", concurrency=2), clock=clock)
    assert source.poll([]) is a and source.poll([]) is b and source.poll([]) is None  # two clients
    clock.t = 1.5
    source.finished(a)
    assert source.poll([]) is c and source.of(c).arrival_s == 1.5  # arrives when a client is free
    times = Arrival("poisson", rate=4.0, seed=1).times(2000)
    assert times == sorted(times) and times[0] == 0.0
    assert abs(times[-1] / 1999 - 0.25) < 0.02  # mean gap 1/rate
    with pytest.raises(ValueError, match="burst, poisson, concurrency"):
        Arrival("uniform")


@pytest.mark.parametrize("method", ["full", "snapkv", "h2o"])
def test_the_pool_holds_at_every_step_and_latencies_are_ordered(loaded, tmp_path, method):
    held = []

    def look(active, pool):
        nbytes = sum(slot.run.cache.nbytes() for slot in active)  # what the running caches hold now
        held.append((nbytes, len(active)))
        assert nbytes <= pool.capacity_bytes

    pool_bytes = 2 * (400 - 200 + 60) * ENTRY  # about two full-cache requests of these prompts
    with Engine(spec(method), loaded=loaded) as engine:
        summary = run_load(engine, ServingSpec(pool_bytes=pool_bytes), tmp_path, on_step=look)
    records = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert len(records) == 5 and not any(r.get("failed") for r in records)
    assert held and summary["steps"] == len(held) and max(n for n, _ in held) == summary["held_peak_bytes"]
    for r in records:
        s = r["serving"]
        assert 0 <= s["queue_s"] <= s["ttft_s"] <= s["e2e_s"] and s["tpot_s"] >= 0
        assert r["kv_bytes_final"] <= s["reserved_bytes"] and s["output_tokens"] == r["new_tokens"]
    running = max(r["serving"]["running"] for r in records)
    assert running == summary["peak_running"] == max(k for _, k in held)
    if method == "full":  # two fit; the rest queue until one leaves
        assert running == 2 and sum(r["serving"]["queue_s"] > 0 for r in records) >= 3
    else:  # 64 + 6 entries each: all five fit at once
        assert running == 5


def test_predictions_under_the_pool_equal_the_engine_alone(loaded, tmp_path):
    with Engine(spec("snapkv"), loaded=loaded) as engine:
        run_load(engine, ServingSpec(pool_bytes=3 * 70 * ENTRY), tmp_path)
        alone = {}
        for sample in engine.samples():
            request = engine.sample_request(sample)
            gen = generate(engine.model, engine.tokenizer, engine.run.method, engine.capture, request.input_ids,
                           request.budget, request.max_new_tokens, request.stop, seed=request.seed)
            alone[sample.id] = gen.text
    records = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert {r["id"]: r["prediction"] for r in records} == alone


def test_a_rerun_resumes(loaded, tmp_path):
    with Engine(spec("snapkv"), loaded=loaded) as engine:
        first = run_load(engine, ServingSpec(pool_bytes=10**6, limit=2), tmp_path)
        before = (tmp_path / "predictions.jsonl").read_bytes()
        second = run_load(engine, ServingSpec(pool_bytes=10**6, limit=5), tmp_path)
    after = (tmp_path / "predictions.jsonl").read_bytes()
    ids = [json.loads(line)["id"] for line in after.splitlines()]
    assert after.startswith(before) and len(ids) == len(set(ids)) == 5  # three new lines, none rewritten
    assert (first["n"], second["n"]) == (2, 5)
    sessions = {json.loads(line)["serving"]["session"] for line in after.splitlines()}
    assert len(sessions) == 2  # the figures span both sessions' wall times


def test_the_command_line_is_checked_before_weights_load():
    specs, servings = parse(["method=full,snapkv", "budget=64", "serving.pool_requests=2", "serving.rate=1,2",
                             "serving.arrival=poisson", "model=tiny_llama"])
    assert [(s.method, s.budget) for s in specs] == [("full", 64), ("snapkv", 64)]
    assert [s.rate for s in servings] == [1, 2]
    with pytest.raises(ValueError, match="no setting 'pool'; valid: .*pool_bytes"):
        parse(["serving.pool=3"])
    with pytest.raises(ValueError, match="one of serving.pool_bytes"):
        parse(["method=snapkv"])
    with pytest.raises(ValueError, match="serving.rate > 0"):
        parse(["serving.pool_bytes=100", "serving.arrival=poisson"])
    run = RunSpec(method="snapkv", budget=64, model="tiny_llama", overrides=("query=agnostic",)).validate()
    with pytest.raises(ValueError, match="use query=aware"):
        check(run, ServingSpec(pool_bytes=100))


def test_the_pareto_front_keeps_what_nothing_beats_on_both_axes():
    # (throughput, accuracy): full is accurate and slow, snapkv faster and less accurate, a third is beaten by both
    points = [(0.6, 1.0), (0.9, 0.6), (0.5, 0.5), (0.9, 0.6), (1.2, 0.2)]
    assert pareto_front(points) == [0, 1, 3, 4]  # (0.5, 0.5) is beaten by (0.6, 1.0); equal points both stay
    assert pareto_front([(1.0, 1.0), (1.0, 0.5)]) == [0]  # the same throughput, less accurate: beaten


def test_ignore_eos_decodes_every_requests_max_new_tokens_into_its_own_run_dir(loaded, tmp_path):
    """`serving.ignore_eos`: EOS held off, so each request's output is its max_new_tokens (6) long, as the ceiling's
    transformers calls are; its records go to another run directory than the natural-stop run's. The tiny model's
    EOS is made the third token each request picks, so a natural run ends there."""
    run = RunSpec(method="snapkv", budget=64, model="tiny_llama", overrides=(*NIAH, "dataset.stop=[]"))
    config = loaded[0].generation_config
    before = config.eos_token_id
    with Engine(run, loaded=loaded) as engine:
        requests = [engine.sample_request(s) for s in engine.samples()]
        prompts = [r.input_ids[0].tolist() for r in requests]
        third = {g.token_ids[2] for g in engine.generate(prompts, 6, batch_size=64)}  # (batched, as run_load is)
        config.eos_token_id = sorted(third)
        try:
            natural, fixed = (ServingSpec(pool_requests=20, ignore_eos=flag) for flag in (False, True))
            summaries = [run_load(engine, s, tmp_path / str(s.ignore_eos)) for s in (natural, fixed)]
        finally:
            config.eos_token_id = before
        assert run_dir_of(engine.run, fixed, 10**6) != run_dir_of(engine.run, natural, 10**6)
    settings = json.loads((tmp_path / "True" / "serving.json").read_text())
    assert settings["pool_bytes"] == summaries[1]["pool_bytes"] > 0 and settings["ignore_eos"] is True  # as run
    lengths = [[json.loads(line)["serving"]["output_tokens"] for line in
                (tmp_path / name / "predictions.jsonl").read_text().splitlines()] for name in ("False", "True")]
    assert [s["n"] for s in summaries] == [5, 5]
    assert max(lengths[0]) <= 2 and lengths[1] == [6] * 5  # natural: ends at its third token (EOS, not kept)
