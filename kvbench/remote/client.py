"""Requests to an OpenAI-compatible server, sent concurrently (async httpx) and streamed, so that each one's time to
first token is the first text chunk's arrival: the run against a server (kvbench.runs.remote) and the load benchmark
(`replay` with its arrival times) both send through here.

    async for i, reply in replay("http://localhost:8000/v1", bodies, arrival_s=[0.0] * 4 + [None] * 60):
        reply.ttft_s, reply.tpot_s, reply.e2e_s, reply.text      # or an Exception: that request failed

`arrival_s[i]` is when request i is sent, in seconds after the replay starts (a Poisson process's times, or all 0),
or None: sent as soon as an earlier request finishes (a closed loop of as many clients as there are times)."""
from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import httpx

from kvbench.remote.spec import ServerProblem, Unreachable
from kvbench.remote.wire import Reply, ServerError, sse_data

PROBE_TIMEOUT_S = 30.0  # /v1/models: a server that is up answers at once; a busy one may take a while


@dataclass
class Timed:
    """One streamed reply and its timings, seconds. `sent_s`: when it was sent, after the replay started;
    `ttft_s`: sent -> first text chunk; `e2e_s`: sent -> end of the stream; `tpot_s`: the time per output token
    after the first ((e2e - ttft) / (tokens - 1); None for one token)."""

    text: str
    finish_reason: str | None
    usage: dict | None
    extra: dict
    sent_s: float
    ttft_s: float | None
    e2e_s: float
    chunks: int  # text-bearing chunks: the output tokens where the server reports no usage
    tokens: int = field(init=False)
    tpot_s: float | None = field(init=False)

    def __post_init__(self):
        reported = (self.usage or {}).get("completion_tokens")
        self.tokens = int(reported) if reported is not None else self.chunks
        self.tpot_s = ((self.e2e_s - self.ttft_s) / (self.tokens - 1)
                       if self.ttft_s is not None and self.tokens > 1 else None)


def headers(api_key_env: str | None) -> dict[str, str]:
    """The Authorization header from the named environment variable (the key itself is never in a config)."""
    key = os.environ.get(api_key_env) if api_key_env else None
    return {"Authorization": f"Bearer {key}"} if key else {}


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict, started: float = 0.0) -> Timed:
    """POST `body` (stream: true) to `url` and read its events to `[DONE]`; timings against `time.perf_counter`.
    An HTTP error status or an `error` event raises ServerError with the server's message."""
    sent = time.perf_counter()
    first = None
    reply = Reply()
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise ServerError(f"HTTP {response.status_code} from {url}: {error_text(await response.aread())}")
        async for line in response.aiter_lines():
            data = sse_data(line)
            if data == "[DONE]":
                break
            if data is not None and reply.take(data) and first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    return Timed(reply.text, reply.finish_reason, reply.usage, reply.extra, sent - started,
                 None if first is None else first - sent, end - sent, len(reply.pieces))


def error_text(raw: bytes, limit: int = 300) -> str:
    """A server's error body as one line: OpenAI's `{"error": {"message": ...}}`, FastAPI's `detail`, or the text."""
    import json

    text = raw.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
        if isinstance(data, dict):
            err = data.get("error", data.get("detail", data.get("message", text)))
            text = str(err.get("message", err) if isinstance(err, dict) else err)
    except ValueError:
        pass
    return " ".join(text.split())[:limit] or "(no body)"


async def replay(base_url: str, bodies: Sequence[dict], arrival_s: Sequence[float | None], timeout_s: float = 600.0,
                 api_key_env: str | None = None, endpoint: str = "completions",
                 on_send: Callable[[int], None] | None = None) -> AsyncIterator[tuple[int, Timed | Exception]]:
    """Send `bodies[i]` at `arrival_s[i]` (module docstring) and yield `(i, Timed)` as each finishes, or
    `(i, exception)` where it failed (HTTP error, a broken stream, no reply within `timeout_s`): the others go on.
    `on_send(i)` is called as request i goes out (the load benchmark counts what is in flight: sent, not yet
    yielded). Closing the generator early cancels what is still in flight."""
    url = f"{base_url.rstrip('/')}/{endpoint}"
    waiting = deque(i for i, t in enumerate(arrival_s) if t is None)
    started = time.perf_counter()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, PROBE_TIMEOUT_S))
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers(api_key_env)) as client:

        async def one(i: int) -> tuple[int, Timed | Exception]:
            if arrival_s[i] is not None:
                await asyncio.sleep(max(0.0, arrival_s[i] - (time.perf_counter() - started)))
            if on_send is not None:
                on_send(i)
            try:
                return i, await asyncio.wait_for(stream_completion(client, url, bodies[i], started), timeout_s)
            except asyncio.TimeoutError:
                return i, TimeoutError(f"no complete reply from {url} within model.timeout_s={timeout_s:g}")
            except Exception as e:  # noqa: BLE001 - this request's failure (HTTP, a broken stream); the others go on
                return i, e

        running = {asyncio.ensure_future(one(i)) for i, t in enumerate(arrival_s) if t is not None}
        try:
            while running:
                finished, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in finished:
                    if waiting:  # a closed loop's client sends its next request
                        running.add(asyncio.ensure_future(one(waiting.popleft())))
                    yield task.result()
        finally:
            for task in running:
                task.cancel()
            if running:
                await asyncio.gather(*running, return_exceptions=True)


def closed_loop(n: int, concurrency: int) -> list[float | None]:
    """Arrival times of `n` requests kept `concurrency` in flight (all the first ones at once)."""
    return [0.0 if i < concurrency else None for i in range(n)]


def probe(base_url: str, model: str, api_key_env: str | None = None, timeout_s: float = PROBE_TIMEOUT_S) -> dict:
    """The server's /v1/models answer, checked: an unreachable server, an API key it wants, or a model it does not
    serve is one line (ServerProblem). A server without /v1/models passes (nothing to check)."""
    url = f"{base_url.rstrip('/')}/models"
    try:
        response = httpx.get(url, headers=headers(api_key_env), timeout=timeout_s)
    except httpx.HTTPError as e:
        raise Unreachable(f"model.base_url={base_url}: no server answers ({type(e).__name__}: {e or 'no reply'}); "
                          "start it (docs/serving.md#client) or fix model.base_url") from None
    if response.status_code in (401, 403):
        raise ServerProblem(f"model.base_url={base_url}: the server wants an API key (HTTP {response.status_code}); "
                         "put it in an environment variable and name it with model.api_key_env=<VAR>")
    if response.status_code != 200:
        return {}
    try:
        listed = [m.get("id") for m in response.json().get("data", [])]
    except (ValueError, AttributeError):
        raise Unreachable(f"model.base_url={base_url}: {url} did not answer as an OpenAI server (not JSON); is it "
                          "the server's /v1 root?") from None
    if listed and model not in listed:
        raise ServerProblem(f"model.base_url={base_url} serves {', '.join(map(str, listed))}, not {model!r}; set "
                         "model.name (or model.served, for a name with '/') to one of those")
    return response.json()
