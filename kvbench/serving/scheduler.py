"""The server's scheduler: HTTP handlers (the asyncio thread) submit requests, one decoder thread runs the engine's
continuous batching over them under the KV pool, and each request's tokens go back to its handler as they come.

Admission is the load benchmark's: a request reserves its bound (`pool.reserved_entries` x the bytes of one entry)
and joins, first come first served, once that fits the pool (`arrivals.PoolSource`, here fed while it runs instead
of from a list, under one lock). A request whose reservation exceeds the whole pool is refused by `check` before it
is queued, so nothing waits forever. Cancelling a request (its client left, or shutdown ran out of grace) withdraws
it if it still waits; if it runs, `Request.cancelled` ends it at the engine's next step, which frees its rows, and
its bytes go back to the pool as any finished request's. Events reach the asyncio side through `Job.post` (the
loop's `call_soon_threadsafe`): ("tokens", ids) after each batched step, then ("done", outcome, timeline)."""
from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvbench.serving.arrivals import Arrival, PoolSource, Timeline
from kvbench.serving.pool import KVPool, KVShape, reserved_entries

logger = logging.getLogger(__name__)


class Refused(ValueError):
    """A request the server cannot take as asked (a 400, or `status`): its message is the one-line reason."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


@dataclass(eq=False)
class Job:
    """One prompt of an HTTP request, as the engine runs it (`request.tag` is the job)."""

    index: int  # the choice it answers
    request: object  # kvbench.engine.batching.Request
    reserved_bytes: int
    post: Callable[[tuple], None]  # hands an event to the handler's loop (thread-safe)
    stream: bool = False  # send ("tokens", ids) after each step
    sent: int = 0  # tokens sent so far
    cancel_reason: str | None = None  # "client" (it left) or "shutdown"
    done: bool = False
    timeline: Timeline | None = field(default=None, repr=False)


class LiveSource(PoolSource):
    """`PoolSource` fed while the engine runs: `add` from the handlers, `poll` / `finished` from the decoder thread,
    all under one lock; `wait` blocks until a request comes or the source closes."""

    def __init__(self, pool: KVPool):
        super().__init__([], [], pool, Arrival("burst"))
        self.lock = threading.Condition()
        self.closed = False

    def add(self, request, reserved_bytes: int) -> None:
        with self.lock:
            self.timeline[id(request)] = Timeline(reserved_bytes=reserved_bytes)
            self.scheduled.append((self.now(), request))
            self.lock.notify_all()

    def poll(self, active):
        with self.lock:
            return super().poll(active)

    def wait(self) -> bool:
        with self.lock:
            while not (self.scheduled or self.waiting or self.closed):
                self.lock.wait()
            return bool(self.scheduled or self.waiting)

    def joined(self, slot, running: int) -> None:
        with self.lock:
            super().joined(slot, running)

    def finished(self, request) -> Timeline:
        with self.lock:
            timeline = super().finished(request)
            del self.timeline[id(request)]
            return timeline

    def withdraw(self, request) -> Timeline | None:
        """Take a request that has not joined out of the queue (nothing was reserved); None if it already left it."""
        with self.lock:
            if request in self.waiting:
                self.waiting.remove(request)
                self.in_system -= 1
            elif any(r is request for _, r in self.scheduled):
                self.scheduled = type(self.scheduled)((at, r) for at, r in self.scheduled if r is not request)
            else:
                return None
            timeline = self.timeline.pop(id(request))
            timeline.finish_s = self.now()
            return timeline

    def queued(self) -> int:
        with self.lock:
            return len(self.scheduled) + len(self.waiting)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.lock.notify_all()


class Scheduler:
    """The engine's decoder on a thread of its own, fed by `submit`; see the module docstring."""

    def __init__(self, engine, pool: KVPool, max_batch: int):
        self.engine, self.pool = engine, pool
        self.entry_bytes = KVShape.of(engine.model).entry_bytes
        self.source = LiveSource(pool)
        self.decoder = engine.decoder(max_batch)
        self.decoder.joins_per_step = 1  # a prefill, then a step: first tokens stream before the next prefill
        self.decoder.on_join = lambda slot: self.source.joined(slot, len(self.decoder.active))
        self.decoder.on_step = self._stream
        self.jobs: set[Job] = set()  # submitted and not done
        self.lock = threading.Lock()
        self.counts: Counter = Counter()  # finished, cancelled, failed
        self.broken: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="kvbench-decoder", daemon=True)

    # --- the handlers' side ---------------------------------------------------------------------------------
    def reservation(self, prompt_len: int, max_new_tokens: int) -> int:
        """The bytes a request of this prompt length and output bound reserves in the pool."""
        budget = self.engine.run.budget_for(prompt_len)
        return reserved_entries(self.engine.run.method, prompt_len, budget, max_new_tokens) * self.entry_bytes

    def check(self, prompt_len: int, max_new_tokens: int) -> int:
        """The reservation, or `Refused` when it can never fit the pool."""
        need = self.reservation(prompt_len, max_new_tokens)
        if need > self.pool.capacity_bytes:
            raise Refused(f"this request's KV reservation ({need} bytes: a {prompt_len}-token prompt and up to "
                          f"{max_new_tokens} new tokens) exceeds the server's whole KV pool ({self.pool.capacity_bytes}"
                          " bytes, serve.pool_bytes); shorten the prompt or lower max_tokens", param="max_tokens")
        return need

    def submit(self, job: Job) -> None:
        """Queue a job whose reservation `check` gave (so it fits the pool once the pool is free)."""
        assert job.reserved_bytes <= self.pool.capacity_bytes, (job.reserved_bytes, self.pool.capacity_bytes)
        if self.broken is not None or self.source.closed:
            raise Refused("the server is shutting down or its engine stopped; retry elsewhere", status=503)
        job.request.tag = job
        with self.lock:
            self.jobs.add(job)
        self.source.add(job.request, job.reserved_bytes)

    def cancel(self, job: Job, reason: str = "client") -> None:
        """End a job that is not done: withdrawn if it waits, else stopped at the engine's next step."""
        if job.done or job.cancel_reason is not None:
            return
        job.cancel_reason = reason
        job.request.cancelled = True
        timeline = self.source.withdraw(job.request)
        if timeline is not None:  # it never joined: answer it here
            self._done(job, None, timeline)

    def cancel_all(self, reason: str) -> None:
        with self.lock:
            jobs = list(self.jobs)
        for job in jobs:
            self.cancel(job, reason)

    def stats(self) -> dict:
        """The pool's account and the requests' counts (`/kvbench/stats`)."""
        return {"pool": {"capacity_bytes": self.pool.capacity_bytes, "used_bytes": self.pool.used_bytes,
                         "peak_bytes": self.pool.peak_bytes},
                "running": len(self.decoder.active), "waiting": self.source.queued(),
                "requests": {k: self.counts[k] for k in ("finished", "cancelled", "failed")},
                "entry_bytes": self.entry_bytes, "max_batch": self.decoder.batch_size}

    # --- the decoder thread -----------------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        """Cancel what is left, let the decoder finish its step and stop."""
        self.cancel_all("shutdown")
        self.source.close()
        self.thread.join()

    def _loop(self) -> None:
        try:
            with torch.no_grad():
                for request, outcome in self.decoder.run(self.source):
                    self._done(request.tag, outcome, self.source.finished(request))
        except BaseException as e:  # noqa: BLE001 - the engine itself failed: every open request is told
            logger.exception("serve: the decoder stopped")
            self.broken = e
            with self.lock:
                jobs = list(self.jobs)
            for job in jobs:
                self._done(job, e, None)

    def _stream(self, active) -> None:
        """After each batched step: each streamed job's new tokens."""
        for slot in active:
            job = slot.request.tag
            if job.stream and len(slot.tokens) > job.sent and not job.request.cancelled:
                job.post(("tokens", slot.tokens[job.sent:]))
                job.sent = len(slot.tokens)

    def _done(self, job: Job, outcome, timeline: Timeline | None) -> None:
        with self.lock:
            if job.done:
                return
            job.done, job.timeline = True, timeline
            self.jobs.discard(job)
            self.counts["failed" if isinstance(outcome, BaseException) else
                        "cancelled" if job.cancel_reason else "finished"] += 1
        job.post(("done", outcome, timeline))
