"""Benchmark (not a test): throughput of the same requests in-process and through the server + client, side by side.

The in-process side is the Python API's engine (`Engine(run).decoder(C).run(requests)`: continuous batching, C at a
time); the served side is `python -m kvbench.serve` with the same method, budget and `serve.max_batch=C`, driven by
the client (kvbench.remote.client) with C requests in flight. Both decode the same NIAH samples of the embedded
model (its pair prompt, configs/model_dataset/smollm2_niah.yaml) greedily. Both are loaded and warmed up (one
request each) first, then the timed set runs `--reps` times on each side, alternating which side goes first, so a
burst of load from other processes hits both alike. Throughput = output tokens / wall seconds from the first request
sent to the last reply. Prints each repetition, the totals, their ratio, whether every prediction is equal, and
the machine's load average before and after (both sides share this machine's cores with anything else running).

    PYTHONPATH=. python scripts/bench_client.py [--method snapkv] [--budget 128] [--concurrency 4] [--reps 2]
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


class InProcess:
    def __init__(self, args, data: list[str]):
        from kvbench.runs.api import Engine, RunSpec

        run = RunSpec(method=args.method, budget=args.budget, batch_size=args.concurrency, overrides=tuple(data))
        self.engine, self.concurrency = Engine(run), args.concurrency
        self.samples = self.engine.samples()
        list(self.engine.decoder(1).run([self.engine.sample_request(self.samples[0])]))  # warm-up

    def timed(self) -> tuple[float, int, dict[str, str]]:
        """(wall s, output tokens, predictions by id) of the timed set."""
        requests = [self.engine.sample_request(s) for s in self.samples]
        t0 = time.perf_counter()
        outcomes = list(self.engine.decoder(self.concurrency).run(requests))
        wall = time.perf_counter() - t0
        failed = [o for _, o in outcomes if isinstance(o, Exception)]
        if failed:
            raise failed[0]
        return wall, sum(len(o.token_ids) for _, o in outcomes), {r.tag[0].id: o.text for r, o in outcomes}


class Served:
    def __init__(self, args, data: list[str]):
        from kvbench.runs.api import RunSpec, open_engine

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.server = subprocess.Popen(
            [sys.executable, "-m", "kvbench.serve", f"method={args.method}", f"budget={args.budget}",
             f"serve.max_batch={args.concurrency}", f"serve.port={port}"], cwd=ROOT, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        wait_healthy(f"http://127.0.0.1:{port}/health", self.server)
        self.engine = open_engine(RunSpec(method="full", model="openai", overrides=(
            f"model.base_url=http://127.0.0.1:{port}/v1", "model.name=smollm2-135m-instruct",
            f"model.concurrency={args.concurrency}", "model_dataset=smollm2_niah", *data)))
        self.samples = self.engine.samples()
        self.bodies = [self.engine.body(s, self.engine.prompt(s)[1]) for s in self.samples]
        asyncio.run(self.send(self.bodies[:1]))  # warm-up

    async def send(self, bodies) -> list:
        return [r async for r in self.engine.replies(bodies)]

    def timed(self) -> tuple[float, int, dict[str, str]]:
        t0 = time.perf_counter()
        replies = asyncio.run(self.send(self.bodies))
        wall = time.perf_counter() - t0
        failed = [r for _, r in replies if isinstance(r, Exception)]
        if failed:
            raise failed[0]
        return wall, sum(r.tokens for _, r in replies), {self.samples[i].id: r.text for i, r in replies}

    def close(self) -> None:
        self.server.send_signal(signal.SIGTERM)
        self.server.wait(timeout=300)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="snapkv")
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1000])
    ap.add_argument("--depths", type=int, nargs="+", default=[0, 25, 50, 75, 100])
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    data = ["dataset=niah", f"dataset.context_lengths=[{','.join(map(str, args.lengths))}]",
            f"dataset.depth_percents=[{','.join(map(str, args.depths))}]"]
    load_before = os.getloadavg()
    sides = {"in-process": InProcess(args, data)}
    sides["served"] = Served(args, data)
    totals = {name: [0.0, 0] for name in sides}
    predictions: dict[str, dict[str, str]] = {}
    print(f"method={args.method} budget={args.budget} concurrency={args.concurrency} lengths={args.lengths} "
          f"depths={args.depths} ({len(sides['in-process'].samples)} requests), {args.reps} repetitions")
    print(f"{'rep':>3} {'side':12} {'wall s':>8} {'out tok':>8} {'tok/s':>8}")
    try:
        for rep in range(args.reps):
            for name in (list(sides) if rep % 2 == 0 else list(sides)[::-1]):
                wall, tokens, predictions[name] = sides[name].timed()
                totals[name][0] += wall
                totals[name][1] += tokens
                print(f"{rep:>3} {name:12} {wall:8.2f} {tokens:8d} {tokens / wall:8.2f}", flush=True)
    finally:
        sides["served"].close()
    load_after = os.getloadavg()
    rate = {name: tokens / wall for name, (wall, tokens) in totals.items()}
    for name, (wall, tokens) in totals.items():
        print(f"all {name:12} {wall:8.2f} {tokens:8d} {rate[name]:8.2f}")
    local, remote = predictions["in-process"], predictions["served"]
    same = sum(local[k] == remote.get(k) for k in local)
    print(f"served / in-process throughput: {rate['served'] / rate['in-process']:.3f}; predictions equal: "
          f"{same}/{len(local)}")
    print(f"load average (1, 5, 15 min): before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
          f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
