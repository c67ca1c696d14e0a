"""Benchmark (not a test): throughput of the same requests in-process and through the server + client, side by side.

The in-process side is the Python API's engine (`Engine(run).decoder(C).run(requests)`: continuous batching, C at a
time); the served side is `python -m kvbench.serve` with the same method, budget and `serve.max_batch=C`, driven by
the client (kvbench.remote.client) with C requests in flight. Both decode the same NIAH samples of the embedded
model (its pair prompt, configs/model_dataset/smollm2_niah.yaml) greedily; each side first runs one warm-up request,
then the timed set. Throughput = output tokens / wall seconds from the first request sent to the last reply. Prints
both, their ratio, whether every prediction is equal, and the machine's load average before and after (the two
sides share this machine's cores with anything else running).

    python scripts/bench_client.py [--method snapkv] [--budget 128] [--concurrency 4] [--lengths 1000 2000]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def in_process(args, data: list[str]) -> tuple[float, int, dict[str, str]]:
    """(wall s, output tokens, predictions by id) of the timed set through the engine in this process."""
    from kvbench.runs.api import Engine, RunSpec

    run = RunSpec(method=args.method, budget=args.budget, batch_size=args.concurrency, overrides=tuple(data))
    with Engine(run) as engine:
        samples = engine.samples()
        list(engine.decoder(1).run([engine.sample_request(samples[0])]))  # warm-up
        requests = [engine.sample_request(s) for s in samples]
        t0 = time.perf_counter()
        outcomes = list(engine.decoder(args.concurrency).run(requests))
        wall = time.perf_counter() - t0
    failed = [o for _, o in outcomes if isinstance(o, Exception)]
    if failed:
        raise failed[0]
    return wall, sum(len(o.token_ids) for _, o in outcomes), {r.tag[0].id: o.text for r, o in outcomes}


def wait_healthy(url: str, proc: subprocess.Popen, deadline_s: float = 900) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            sys.exit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    sys.exit(f"no answer from {url} in {deadline_s} s")


def served(args, data: list[str]) -> tuple[float, int, dict[str, str]]:
    """The same through `python -m kvbench.serve` and the client."""
    from kvbench.remote.client import closed_loop
    from kvbench.runs.api import RunSpec, open_engine

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "kvbench.serve", f"method={args.method}",
                               f"budget={args.budget}", f"serve.max_batch={args.concurrency}", f"serve.port={port}"],
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", server)
        spec = RunSpec(method="full", model="openai", overrides=(
            f"model.base_url=http://127.0.0.1:{port}/v1", "model.name=smollm2-135m-instruct",
            f"model.concurrency={args.concurrency}", "model_dataset=smollm2_niah", *data))
        engine = open_engine(spec)
        samples = engine.samples()
        bodies = [engine.body(s, engine.prompt(s)[1]) for s in samples]

        async def send(batch) -> tuple[float, list]:
            t0 = time.perf_counter()
            replies = [r async for r in engine.replies(batch)]
            return time.perf_counter() - t0, replies

        asyncio.run(send(bodies[:1]))  # warm-up
        wall, replies = asyncio.run(send(bodies))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=300)
    failed = [r for _, r in replies if isinstance(r, Exception)]
    if failed:
        raise failed[0]
    return wall, sum(r.tokens for _, r in replies), {samples[i].id: r.text for i, r in replies}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="snapkv")
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1000])
    ap.add_argument("--depths", type=int, nargs="+", default=[0, 25, 50, 75, 100])
    args = ap.parse_args()
    data = ["dataset=niah", f"dataset.context_lengths=[{','.join(map(str, args.lengths))}]",
            f"dataset.depth_percents=[{','.join(map(str, args.depths))}]"]
    load_before = os.getloadavg()
    local = in_process(args, data)
    remote = served(args, data)
    load_after = os.getloadavg()
    print(f"method={args.method} budget={args.budget} concurrency={args.concurrency} lengths={args.lengths} "
          f"depths={args.depths} ({len(local[2])} requests)")
    print(f"{'':12} {'wall s':>8} {'out tok':>8} {'tok/s':>8}")
    for name, (wall, tokens, _) in (("in-process", local), ("served", remote)):
        print(f"{name:12} {wall:8.2f} {tokens:8d} {tokens / wall:8.2f}")
    ratio = (remote[1] / remote[0]) / (local[1] / local[0])
    same = sum(local[2][k] == remote[2].get(k) for k in local[2])
    print(f"served / in-process throughput: {ratio:.3f}; predictions equal: {same}/{len(local[2])}")
    print(f"load average (1, 5, 15 min): before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
          f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
