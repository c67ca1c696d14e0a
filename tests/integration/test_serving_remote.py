"""The load benchmark driving a real `python -m kvbench.serve` on localhost through the client (`model=openai`;
kvbench/serving/remote_load.py), on the tiny random Llama: the same greedy predictions, scores, KV bytes and
reservations as the in-process load benchmark of the same configuration; every record has its client-side
`serving` timings (and the server's queue time), sent no earlier than the arrival process says; summary.json has
the figures; a rerun resumes, and a request the server refuses is a failure record. The server helpers are
test_client_server.py's (one server for the module); no wait is against a clock, nothing is timed."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.test_client_server import free_port, full_server  # noqa: F401 - the module's server fixture

pytestmark = pytest.mark.slow
NIAH = ["dataset=niah", "dataset.context_lengths=[300]", "dataset.depth_percents=[0,50,100]"]


def load(argv: list[str], results: Path) -> tuple[dict, dict[str, list[dict]], Path]:
    """`python -m kvbench.serving <argv>` in this process: (summary.json, records by id, the run dir)."""
    from kvbench.serving.__main__ import main

    main([*argv, f"serving.results_dir={results}"])
    [summary_path] = (results / "serving").rglob("summary.json")
    records: dict[str, list[dict]] = {}
    for line in (summary_path.parent / "predictions.jsonl").read_text().splitlines():
        record = json.loads(line)
        records.setdefault(record["id"], []).append(record)
    return json.loads(summary_path.read_text()), records, summary_path.parent


def remote(url: str, *extra: str) -> list[str]:
    return ["model=openai", f"model.base_url={url}", "model.name=tiny-llama", "method=full", *extra]


def in_flight_by_intervals(records: list[dict], i: int) -> int:
    """Requests whose [sent, reply ended) holds request i's send (itself included): the fewest the client's own
    count can show (its count drops only once it has read a reply's end)."""
    sent = records[i]["serving"]["arrival_s"]
    return sum(r["serving"]["arrival_s"] <= sent < r["serving"]["finish_s"] for r in records)


def test_the_load_benchmark_through_the_server_gives_the_in_process_run(full_server, tmp_path):  # noqa: F811
    from kvbench.serving.arrivals import Arrival

    poisson = ["serving.arrival=poisson", "serving.rate=2", "serving.limit=3"]
    local_summary, local, _ = load(["model=tiny_llama", "method=full", *NIAH, *poisson, "serving.pool_requests=4"],
                                   tmp_path / "local")
    summary, served, run_dir = load(remote(full_server, *NIAH, *poisson), tmp_path / "served")
    assert run_dir.name.startswith("all-server-poisson2-")
    assert sorted(served) == sorted(local) and len(served) == 3
    for sample_id, [mine] in local.items():
        [theirs] = served[sample_id]
        assert (theirs["prediction"], theirs["new_tokens"], theirs["scores"], theirs["kv_bytes"]) == \
            (mine["prediction"], mine["new_tokens"], mine["scores"], mine["kv_bytes"])
        timed = theirs["serving"]
        assert timed["output_tokens"] == mine["new_tokens"] == theirs["usage"]["completion_tokens"]
        assert timed["reserved_bytes"] == mine["serving"]["reserved_bytes"]  # the server's pool admits alike
        assert 0 < timed["ttft_s"] <= timed["e2e_s"] and timed["tpot_s"] >= 0 and timed["queue_s"] >= 0
        assert timed["finish_s"] == timed["arrival_s"] + timed["e2e_s"] and timed["running"] >= 1
    # each request went out no earlier than the Poisson process's time for it (the samples in the dataset's order)
    times = Arrival("poisson", rate=2).times(3)
    order = ["niah-L300-d0", "niah-L300-d50", "niah-L300-d100"]  # as the dataset builds them
    assert all(served[i][0]["serving"]["arrival_s"] >= t for i, t in zip(order, times))
    records = [r for [r] in served.values()]
    assert all(r["serving"]["running"] >= in_flight_by_intervals(records, k) for k, r in enumerate(records))
    assert summary["n"] == 3 and summary["n_failed"] == 0 and summary["pool_bytes"] is None
    assert summary["accuracy"] == local_summary["accuracy"]
    assert summary["peak_running"] == max(r["serving"]["running"] for r in records)
    assert summary["output_tok_s"] > 0 and summary["requests_s"] > 0
    assert set(summary) >= {"queue_s", "ttft_s", "tpot_s", "e2e_s", "kv_bytes_mean", "kv_reserved_bytes_mean"}
    settings = json.loads((run_dir / "serving.json").read_text())
    assert settings["server"]["base_url"] == full_server and settings["pool_bytes"] is None
    # all at once: each goes out before any reply can end, so the client counts 1, 2, 3 in flight
    burst, at_once, _ = load(remote(full_server, *NIAH, "serving.arrival=burst", "serving.limit=3"),
                             tmp_path / "burst")
    assert sorted(r["serving"]["running"] for [r] in at_once.values()) == [1, 2, 3] and burst["peak_running"] == 3
    assert {i: r["prediction"] for i, [r] in at_once.items()} == {i: r["prediction"] for i, [r] in local.items()}


def test_a_rerun_resumes_and_a_refused_request_is_a_failure_record(full_server, tmp_path):  # noqa: F811
    args = remote(full_server, "dataset=niah", "dataset.context_lengths=[300,700]", "dataset.depth_percents=[0,100]",
                  "serving.arrival=concurrency", "serving.concurrency=2")
    first, _, run_dir = load([*args, "serving.limit=1"], tmp_path)
    before = (run_dir / "predictions.jsonl").read_bytes()
    summary, records, again = load(args, tmp_path)
    assert again == run_dir and (run_dir / "predictions.jsonl").read_bytes().startswith(before)
    assert {i: len(rs) for i, rs in records.items()} == {
        "niah-L300-d0": 1, "niah-L300-d100": 1, "niah-L700-d0": 1, "niah-L700-d100": 1}  # d0 of L300 never resent
    failed = {i for i, [r] in records.items() if r.get("failed")}
    assert failed == {"niah-L700-d0", "niah-L700-d100"}  # over the server's serve.max_prompt_tokens
    assert all("HTTP 400" in records[i][0]["error"] for i in failed)
    assert (first["n"], summary["n"], summary["n_failed"]) == (1, 2, 2)
    done = [r for [r] in records.values() if not r.get("failed")]
    assert len({r["serving"]["session"] for r in done}) == 2  # the figures span both sessions
    assert summary["peak_running"] <= 2  # a closed loop of two clients never has more in flight


def test_pool_settings_and_a_missing_server_are_one_line(tmp_path):
    from kvbench.serving.__main__ import main, parse

    for setting in ("serving.pool_bytes=1000000", "serving.pool_requests=2", "serving.max_batch=8"):
        with pytest.raises(ValueError, match=f"^serving: {setting} with model=openai: the KV pool and the batch are "
                                             "the server's"):
            parse(["model=openai", setting])
    with pytest.raises(ValueError, match="run them as two commands"):
        parse(["model=openai,tiny_llama"])
    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(SystemExit) as stop:
        main(remote(url, *NIAH, f"serving.results_dir={tmp_path}"))
    assert str(stop.value).startswith(f"kvbench: model.base_url={url}: no server answers")
    assert list(tmp_path.iterdir()) == []
