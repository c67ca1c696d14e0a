"""The client against a real `python -m kvbench.serve` on localhost (started and stopped here; no mocked HTTP), on
the tiny random Llama: the same greedy predictions, scores and KV bytes as the in-process run of the same
configuration (full, and SnapKV served vs SnapKV in-process); a request the server refuses (a prompt over its
limit) is a failure record and the run goes on; a rerun skips finished ids; an unreachable server is one line and
writes nothing. No wait is against a clock (tests/unit/test_no_deadlines.py): the server's /health is waited for
while its process lives; nothing is timed. tests/integration/test_serving_remote.py reuses `serving` and
`full_server`."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.unit.test_server import free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
NIAH = ["dataset=niah", "dataset.context_lengths=[300]", "dataset.depth_percents=[0,50,100]", "report=false"]
SERVER_MAX_PROMPT = 400  # serve.max_prompt_tokens: a 700-token NIAH prompt is refused with a 400


@contextlib.contextmanager
def serving(log: Path, *args: str):
    """`python -m kvbench.serve <args>` on a free port until /health answers (or the process exits: its log is the
    failure); its base URL. Stopped by SIGTERM, waited for."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvbench.serve", *args, f"serve.port={port}"], cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        while True:  # until /health answers, or the process has exited (its log is the failure); no clock
            assert proc.poll() is None, f"the server exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=None).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait()


@pytest.fixture(scope="module")
def full_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "full.log"
    with serving(log, "model=tiny_llama", "method=full", "serve.max_batch=4",
                 f"serve.max_prompt_tokens={SERVER_MAX_PROMPT}") as url:
        yield url


def run(overrides: list[str], results: Path) -> tuple[dict, dict[str, list[dict]]]:
    """`python -m kvbench.run <overrides>`'s runner, in this process: (scores.json, records by id)."""
    from kvbench.runs.api import Run, compose
    from kvbench.runs.run import run as run_config
    from kvbench.runs.validate import quiet

    with quiet():
        cfg, choices = compose([*overrides, f"results_dir={results}"])
    validated = Run.from_config(cfg, choices)
    run_config(cfg, results / "run", validated.job, choices)
    records: dict[str, list[dict]] = {}
    for line in (results / "run" / "predictions.jsonl").read_text().splitlines():
        record = json.loads(line)
        records.setdefault(record["id"], []).append(record)
    return json.loads((results / "run" / "scores.json").read_text()), records


def client(url: str, *extra: str) -> list[str]:
    return ["model=openai", f"model.base_url={url}", "model.name=tiny-llama", "model.concurrency=4", "method=full",
            *extra]


def assert_same_generations(local: dict[str, list[dict]], served: dict[str, list[dict]]) -> None:
    assert sorted(local) == sorted(served)
    for sample_id, [mine] in local.items():
        [theirs] = served[sample_id]
        assert theirs["prediction"] == mine["prediction"], sample_id
        assert (theirs["new_tokens"], theirs["prompt_tokens"], theirs["scores"]) == \
            (mine["new_tokens"], mine["prompt_tokens"], mine["scores"])
        assert theirs["usage"]["completion_tokens"] == mine["new_tokens"]
        assert theirs["kv_bytes"] == mine["kv_bytes"]  # the server's own account, read back from its stream
        assert theirs["ttft_s"] > 0 and theirs["e2e_s"] >= theirs["ttft_s"]


def test_full_through_the_server_gives_the_in_process_predictions_and_scores(full_server, tmp_path):
    local_scores, local = run(["model=tiny_llama", "method=full", *NIAH], tmp_path / "local")
    served_scores, served = run(client(full_server, *NIAH), tmp_path / "served")
    assert_same_generations(local, served)
    assert served_scores["metrics"] == local_scores["metrics"] and served_scores["n"] == 3


def test_snapkv_served_gives_snapkv_in_process(tmp_path):
    budget = ["method.window=8", "budget=64"]
    local_scores, local = run(["model=tiny_llama", "method=snapkv", *budget, *NIAH], tmp_path / "local")
    with serving(tmp_path / "snapkv.log", "model=tiny_llama", "method=snapkv", *budget, "serve.max_batch=4") as url:
        served_scores, served = run(client(url, *NIAH), tmp_path / "served")
    assert_same_generations(local, served)
    assert served_scores["metrics"] == local_scores["metrics"]
    assert all(r["kv_bytes"] < r["server"]["kvbench"]["full_kv_bytes"] for [r] in served.values())  # it compressed


def test_a_refused_request_is_a_failure_record_and_a_rerun_skips_finished_ids(full_server, tmp_path):
    args = client(full_server, "dataset=niah", "dataset.context_lengths=[300,700]", "dataset.depth_percents=[0,100]",
                  "report=false")
    scores, records = run(args, tmp_path)
    failed = {i for i, [r] in records.items() if r.get("failed")}
    assert failed == {"niah-L700-d0", "niah-L700-d100"}  # prompts over the server's serve.max_prompt_tokens
    assert all("HTTP 400" in records[i][0]["error"] for i in failed)
    assert scores["n"] == 2 and scores["n_failed"] == 2
    before = (tmp_path / "run" / "predictions.jsonl").read_bytes()
    scores, records = run(args, tmp_path)  # resumed: the failed ones are retried, the finished ones never re-sent
    assert (tmp_path / "run" / "predictions.jsonl").read_bytes().startswith(before)
    assert Counter({i: len(rs) for i, rs in records.items()}) == Counter(
        {"niah-L300-d0": 1, "niah-L300-d100": 1, "niah-L700-d0": 2, "niah-L700-d100": 2})


def test_an_unreachable_server_is_one_line_and_writes_nothing(tmp_path):
    url = f"http://127.0.0.1:{free_port()}/v1"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "kvbench.run", *client(url, *NIAH), f"results_dir={tmp_path / 'r'}"],
                          cwd=ROOT, capture_output=True, text=True, env=env)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [f"kvbench: model.base_url={url}: no server answers (ConnectError: "
                                                "[Errno 111] Connection refused); start it (docs/serving.md#client) "
                                                "or fix model.base_url"]
    assert not (tmp_path / "r").exists()


def test_the_api_generates_through_the_server_as_in_process(full_server):
    from kvbench.runs.api import Engine, RunSpec, open_engine

    prompts = ["The river was calm and the boats stayed home. The pass key is 68302. The pass key is", [1, 2, 3, 4]]
    served = open_engine(RunSpec(model="openai", method="full", overrides=(
        f"model.base_url={full_server}", "model.name=tiny-llama"))).generate(prompts, max_new_tokens=8)
    with Engine(RunSpec(model="tiny_llama", method="full")) as engine:
        local = engine.generate(prompts, max_new_tokens=8)
    assert [r.text for r in served] == [g.text for g in local]
    assert [r.tokens for r in served] == [len(g.token_ids) for g in local]


def test_replay_keeps_its_arrival_process(full_server):
    """A closed loop of one client sends each request only after the previous reply ended; a burst sends all before
    any reply ends (the load benchmark's arrival processes, kvbench.serving.arrivals, plug in as `arrival_s`)."""
    import asyncio

    from kvbench.remote.client import closed_loop, replay
    from kvbench.remote.wire import completion_body

    bodies = [completion_body("tiny-llama", [1, 2, 3, 4 + i], 6) for i in range(3)]

    async def send(arrival_s):
        return dict([item async for item in replay(full_server, bodies, arrival_s)])

    one_client = asyncio.run(send(closed_loop(3, 1)))
    ends = sorted((r.sent_s, r.sent_s + r.e2e_s) for r in one_client.values())
    assert all(later_sent >= earlier_end for (_, earlier_end), (later_sent, _) in zip(ends, ends[1:]))
    burst = asyncio.run(send([0.0, 0.0, 0.0]))
    assert max(r.sent_s for r in burst.values()) < min(r.sent_s + r.e2e_s for r in burst.values())
    assert all(r.tokens == 6 and r.finish_reason == "length" for r in [*one_client.values(), *burst.values()])
