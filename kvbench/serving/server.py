"""The OpenAI-compatible server on kvbench's engine (`python -m kvbench.serve <run overrides> serve.port=8000`).

FastAPI + uvicorn on the asyncio side; the engine's continuous batching under a KV pool on one decoder thread
(kvbench.serving.scheduler). Endpoints: `/v1/completions` (a prompt as text, read as given, or token ids; or a
list of either), `/v1/chat/completions` (messages rendered with the model's chat template), both streamed on
`stream: true` (server-sent events, `data: [DONE]` last); `/v1/models`; `/health`; `/kvbench/stats` (the pool's
bytes and the requests' counts). Bad input is a 400 in OpenAI's error body, and the server goes on.

Shutdown (SIGTERM, SIGINT): no new connections; what is in flight gets `serve.grace_s` seconds to finish, then it
is cancelled (a waiting client gets a 503, a streamed one an error event and `[DONE]`); the process exits 0."""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import json
import logging
import signal
import sys
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import yaml
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.responses import StreamingResponse

from kvbench.runs.api import Engine, Run, RunSpec
from kvbench.serving.pool import KVPool, KVShape, check_bounded
from kvbench.serving.scheduler import Job, Refused, Scheduler
from kvbench.serving.wire import (ChatRequest, CompletionRequest, Knobs, TextStream, chunk_choice, completion_choice,
                                  envelope, error_body, finish_reason, kvbench_fields, new_id, sampling_of, usage_of)

logger = logging.getLogger(__name__)
RUN_KEYS = ("method", "budget", "ratio", "model", "dataset")  # RunSpec's own fields on the command line
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat's is serve.max_tokens


@dataclass(frozen=True)
class ServeSpec:
    """The server's own settings (`serve.<field>=` on the command line)."""

    host: str = "127.0.0.1"
    port: int = 8000
    pool_bytes: int | None = None  # the KV pool; or instead:
    pool_requests: float | None = None  # a pool of this many full-cache requests of the longest allowed (default:
    #                                     max_batch of them)
    max_batch: int = 8  # the most requests decoding at once, whatever the pool allows
    max_prompt_tokens: int | None = None  # longer prompts get a 400 (default: the model config's max_prompt_tokens)
    max_tokens: int = 1024  # the most new tokens a request may ask for; chat's default
    model_name: str | None = None  # the id clients name (default: the model config's name)
    grace_s: float = 60.0  # on SIGTERM / SIGINT, what runs gets this long to finish before it is cancelled

    def __post_init__(self):
        if not 1 <= self.port <= 65535:
            raise ValueError(f"serve: port={self.port} must be in 1..65535")
        if self.pool_bytes is not None and self.pool_requests is not None:
            raise ValueError("serve: set serve.pool_bytes or serve.pool_requests, not both")
        for name in ("pool_bytes", "pool_requests", "max_batch", "max_prompt_tokens", "max_tokens"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"serve: {name}={value} must be > 0")
        if self.grace_s < 0:
            raise ValueError(f"serve: grace_s={self.grace_s} must be >= 0")


def parse(argv: list[str]) -> tuple[RunSpec, ServeSpec]:
    """A command line's run spec (its `serve.max_batch` is the run's batch size) and serve spec, each checked."""
    fields = {f.name: f for f in dataclasses.fields(ServeSpec)}
    run_values, serve_values, overrides = {}, {}, []
    for arg in argv:
        key, eq, text = arg.partition("=")
        if not eq:
            raise ValueError(f"serve: {arg!r} is not key=value")
        if key.startswith("serve."):
            name = key.removeprefix("serve.")
            if name not in fields:
                raise ValueError(f"serve: no setting {name!r}; valid: {', '.join(sorted(fields))}")
            value = yaml.safe_load(text)
            serve_values[name] = text if name in ("host", "model_name") else value
        elif key == "batch_size":
            raise ValueError("serve: the batch is serve.max_batch (the most requests decoding at once); drop "
                             "batch_size")
        elif key in RUN_KEYS:
            run_values[key] = yaml.safe_load(text)
        else:
            overrides.append(arg)
    for name, value in serve_values.items():
        kind = {"port": int, "max_batch": int, "max_tokens": int, "max_prompt_tokens": int, "pool_bytes": int,
                "pool_requests": float, "grace_s": float}.get(name)
        if kind is not None and value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                                          or (kind is int and value != int(value))):
            raise ValueError(f"serve: {name}={value!r} must be {'an integer' if kind is int else 'a number'}")
        if kind is not None and value is not None:
            serve_values[name] = kind(value)
    serve = ServeSpec(**serve_values)
    return RunSpec(**run_values, batch_size=serve.max_batch, overrides=tuple(overrides)), serve


def check_servable(run: Run) -> None:
    """What the server needs of a run, before weights load: a KV bound to admit by, one sequence per request."""
    from kvbench.runs.config import decode_compression

    check_bounded(run.method, decode_compression(run.cfg).on)
    if run.cfg.generation.get("num_beams", 1) > 1:
        raise ValueError("serve: requests decode greedily or by sampling, not by beam search; use "
                         "generation.num_beams=1")
    if run.cfg.get("query", "aware") != "aware":
        raise ValueError("serve: a request's prompt is prefilled whole, then compressed; use query=aware")


def pool_of(serve: ServeSpec, max_prompt_tokens: int, entry_bytes: int) -> KVPool:
    """`serve.pool_bytes`, or `pool_requests` (default: max_batch) full-cache requests of the longest allowed."""
    if serve.pool_bytes is not None:
        return KVPool(serve.pool_bytes)
    n = serve.pool_requests if serve.pool_requests is not None else serve.max_batch
    return KVPool(int(n * (max_prompt_tokens + serve.max_tokens) * entry_bytes))


class CancellingStream(StreamingResponse):
    """A streamed response that cancels its jobs when it ends for any reason (the client left mid-stream)."""

    def __init__(self, body: AsyncIterator[str], on_close):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


class Server:
    """The engine behind the endpoints: prompts to jobs, jobs to OpenAI bodies."""

    def __init__(self, engine: Engine, serve: ServeSpec):
        self.engine, self.serve = engine, serve
        self.run = engine.run
        self.tokenizer = copy.deepcopy(engine.tokenizer)  # the handlers' own: the decoder thread uses the engine's
        self.model_name = serve.model_name or str(self.run.cfg.model.name)
        self.max_prompt_tokens = serve.max_prompt_tokens or int(self.run.model.max_prompt_tokens)
        self.decoding = self.run.decoding()
        self.vocab = engine.model.get_input_embeddings().num_embeddings
        shape = KVShape.of(engine.model)
        self.scheduler = Scheduler(engine, pool_of(serve, self.max_prompt_tokens, shape.entry_bytes), serve.max_batch)

    # --- requests to jobs ---------------------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name not in (None, self.model_name):
            raise Refused(f"model {name!r} is not served here; this server serves {self.model_name!r}", status=404,
                          param="model")

    def ids_of(self, prompt: str | list[int]) -> list[int]:
        """A completion prompt's token ids: text as given (no chat template), ids checked against the vocabulary."""
        if isinstance(prompt, str):
            return self.tokenizer(prompt).input_ids
        bad = [t for t in prompt if not 0 <= t < self.vocab]
        if bad:
            raise Refused(f"prompt: token id {bad[0]} is outside the vocabulary (0..{self.vocab - 1})", param="prompt")
        return list(prompt)

    def chat_ids(self, body: ChatRequest) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise Refused(f"{self.model_name} has no chat template; use /v1/completions with a rendered prompt",
                          param="messages")
        text = self.tokenizer.apply_chat_template(body.dialogue(), tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def jobs(self, body: Knobs, prompts: list[list[int]], max_new: int, post) -> list[Job]:
        """Every prompt checked (length, pool) before any is queued, so a refusal queues nothing."""
        if max_new > self.serve.max_tokens:
            raise Refused(f"max_tokens={max_new} is above this server's limit ({self.serve.max_tokens}, "
                          "serve.max_tokens)", param="max_tokens")
        stops, sampling = body.stops(), sampling_of(body, self.decoding.sampling)
        decoding = dataclasses.replace(self.decoding, sampling=sampling) if sampling is not None else None
        jobs = []
        for index, ids in enumerate(prompts):
            if not ids:
                raise Refused("prompt is empty (no tokens)", param="prompt")
            if len(ids) > self.max_prompt_tokens:
                raise Refused(f"prompt has {len(ids)} tokens; this server takes at most {self.max_prompt_tokens} "
                              "(serve.max_prompt_tokens)", param="prompt")
            reserved = self.scheduler.check(len(ids), max_new)
            request = self.engine.request(ids, max_new, stops)
            request.decoding = decoding
            request.min_new_tokens = max_new if body.ignore_eos else min(body.min_tokens, max_new)
            jobs.append(Job(index, request, reserved, functools.partial(post, index), stream=body.stream))
        return jobs

    async def answer(self, body: Knobs, http, chat: bool):
        """A completion or chat completion: its jobs queued, then collected or streamed."""
        body.refuse_unsupported()
        self.check_model(body.model)
        if chat:
            prompts = [self.chat_ids(body)]
            max_new = body.max_tokens or body.max_completion_tokens or self.serve.max_tokens
        else:
            prompts = [self.ids_of(p) for p in body.prompts()]
            max_new = body.max_tokens or COMPLETION_MAX_TOKENS
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()

        def post(index: int, event: tuple) -> None:  # (the decoder thread)
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (index, event))
            except RuntimeError:  # the loop has closed: nobody is listening
                pass

        jobs = self.jobs(body, prompts, max_new, post)
        try:
            for job in jobs:
                self.scheduler.submit(job)
        except Refused:
            self.cancel(jobs)
            raise
        rid = new_id("chatcmpl" if chat else "cmpl")
        if body.stream:
            return CancellingStream(self.stream(body, jobs, queue, rid, chat), lambda: self.cancel(jobs))
        outcomes = await self.collect(jobs, queue, http)
        if outcomes is None:  # the client left; nobody reads this
            return JSONResponse(error_body("client closed the request"), status_code=499)
        failure = next((problem for job in jobs if (problem := self.problem(job, outcomes[job.index]))), None)
        if failure is not None:
            return JSONResponse(failure[1], status_code=failure[0])
        choices = [completion_choice(chat, job.index, outcomes[job.index].text, finish_reason(outcomes[job.index]),
                                     kvbench_fields(job, outcomes[job.index])) for job in jobs]
        usage = usage_of(sum(len(p) for p in prompts), sum(len(o.token_ids) for o in outcomes.values()))
        return JSONResponse({**envelope(chat, False, rid, self.model_name, choices, usage), "kvbench": self.about()})

    def cancel(self, jobs: list[Job], reason: str = "client") -> None:
        for job in jobs:
            self.scheduler.cancel(job, reason)

    async def collect(self, jobs: list[Job], queue: asyncio.Queue, http) -> dict | None:
        """Each job's outcome by index; None (and the jobs cancelled) if the client disconnects first."""
        async def disconnected() -> None:
            while (await http.receive())["type"] != "http.disconnect":
                pass

        outcomes: dict = {}
        watcher = asyncio.ensure_future(disconnected())
        try:
            while len(outcomes) < len(jobs):
                getter = asyncio.ensure_future(queue.get())
                finished, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in finished:
                    getter.cancel()
                    self.cancel(jobs)
                    return None
                index, event = getter.result()
                if event[0] == "done":
                    outcomes[index] = event[1]
            return outcomes
        finally:
            watcher.cancel()
            self.cancel(jobs)  # (a no-op for jobs that are done; the handler's task cancelled at shutdown: not)

    def problem(self, job: Job, outcome) -> tuple[int, dict] | None:
        """(status, error body) for a job that failed or was cancelled; None for a reply."""
        if isinstance(outcome, BaseException):
            return 500, error_body(f"the engine failed on this request: {type(outcome).__name__}: {outcome}",
                                   "server_error")
        if outcome is None or outcome.stop_reason == "cancelled":
            made = len(outcome.token_ids) if outcome is not None else 0
            return 503, error_body(f"the server shut down before this request finished ({made} tokens made); retry",
                                   "server_error", code="shutdown")
        return None

    async def stream(self, body: Knobs, jobs: list[Job], queue: asyncio.Queue, rid: str,
                     chat: bool) -> AsyncIterator[str]:
        """Server-sent events: each step's new text per choice, then each choice's finish (with its kvbench
        fields), the usage if asked (`stream_options.include_usage`), and `[DONE]`."""
        texts = {job.index: TextStream(self.tokenizer, body.stops()) for job in jobs}
        by_index = {job.index: job for job in jobs}
        model, usage = self.model_name, [len(job.request.input_ids[0]) for job in jobs]
        made = 0

        def chunk(choice: dict) -> str:
            return sse(envelope(chat, True, rid, model, [choice]))

        if chat:
            for job in jobs:
                yield chunk(chunk_choice(True, job.index, None, None, first=True))
        open_jobs = len(jobs)
        while open_jobs:
            index, event = await queue.get()
            if event[0] == "tokens":
                if piece := texts[index].push(event[1]):
                    yield chunk(chunk_choice(chat, index, piece, None))
                continue
            outcome, job = event[1], by_index[index]
            if (failure := self.problem(job, outcome)) is not None:
                self.cancel(jobs)
                yield sse(failure[1])
                yield "data: [DONE]\n\n"
                return
            if piece := texts[index].final(outcome.text):
                yield chunk(chunk_choice(chat, index, piece, None))
            yield chunk(chunk_choice(chat, index, None, finish_reason(outcome), extra=kvbench_fields(job, outcome)))
            made += len(outcome.token_ids)
            open_jobs -= 1
        if body.stream_options is not None and body.stream_options.include_usage:
            yield sse(envelope(chat, True, rid, model, [], usage_of(sum(usage), made)))
        yield "data: [DONE]\n\n"

    def about(self) -> dict:
        """The run this server decodes with (the response's `kvbench` object and `/v1/models`)."""
        cfg = self.run.cfg
        return {"method": self.run.choices.get("method", self.run.method.registry_name), "budget": cfg.budget,
                "ratio": cfg.ratio, "model": self.model_name}


def build_app(server: Server):
    """The FastAPI app over `server`; its lifespan starts the decoder thread and stops it at shutdown."""

    @asynccontextmanager
    async def lifespan(app):
        server.scheduler.start()
        yield
        await asyncio.to_thread(server.scheduler.close)

    app = FastAPI(title="kvbench", lifespan=lifespan)

    @app.exception_handler(Refused)
    async def refused(request: Request, e: Refused):
        kind = "not_found_error" if e.status == 404 else "server_error" if e.status >= 500 else "invalid_request_error"
        return JSONResponse(error_body(str(e), kind, e.param), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def malformed(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {"loc": (), "msg": "malformed request", "type": ""}
        if first["type"] == "json_invalid":
            error = first.get("ctx", {}).get("error", "")
            return JSONResponse(error_body(f"the request body is not valid JSON ({error})"), status_code=400)
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        message = f"{where}: {first['msg']}" if where else f"request body: {first['msg']}"
        return JSONResponse(error_body(message, param=where or None), status_code=400)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await server.answer(body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        return await server.answer(body, request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": 0,
                                            "owned_by": "kvbench", "kvbench": server.about()}]}

    @app.get("/health")
    async def health():
        alive = server.scheduler.thread.is_alive() and server.scheduler.broken is None
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)

    @app.get("/kvbench/stats")
    async def stats():
        return {**server.scheduler.stats(), **server.about()}

    return app


def serve_forever(server: Server) -> None:
    """uvicorn until SIGTERM / SIGINT; in-flight requests are cancelled after `grace_s` (see the module doc)."""
    import uvicorn

    class Uvicorn(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit:
                logger.info("serve: shutting down; requests in flight get %ss to finish", server.serve.grace_s)
                timer = threading.Timer(server.serve.grace_s, server.scheduler.cancel_all, args=("shutdown",))
                timer.daemon = True
                timer.start()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(build_app(server), host=server.serve.host, port=server.serve.port, log_level="info",
                            timeout_graceful_shutdown=server.serve.grace_s + 30, lifespan="on")
    # uvicorn raises the signal it stopped on again once it has shut down, with the handlers it found restored:
    # these, so that a clean shutdown exits 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    Uvicorn(config).run()


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        spec, serve = parse(argv)
        run = spec.validate()  # every check before weights load
        check_servable(run)
    except (ValueError, KeyError, FileNotFoundError) as e:
        sys.exit(f"kvbench: {e.args[0] if isinstance(e, KeyError) and e.args else e}")
    with Engine(run) as engine:
        server = Server(engine, serve)
        pool = server.scheduler.pool.capacity_bytes
        logger.info("kvbench serve: http://%s:%d | model %s | %s | pool %d bytes (%d entries) | max_batch %d",
                    serve.host, serve.port, server.model_name, server.about(), pool,
                    pool // server.scheduler.entry_bytes, serve.max_batch)
        serve_forever(server)
    logger.info("kvbench serve: stopped")
