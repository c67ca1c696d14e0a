"""When requests arrive, and which may join the running batch now: the engine's `Source` (kvbench.engine.batching).

Three arrival processes: `burst` (all at time 0), `poisson` (exponential gaps at `rate` requests/s, seeded) and
`concurrency` (a closed loop of `concurrency` clients: a request arrives when an earlier one finishes). Admission is
first come, first served: the oldest waiting request joins once its reservation (kvbench.serving.pool) fits the pool;
the ones behind it wait (no overtaking, as vLLM's default scheduler). A request larger than the whole pool can never
run: it is set aside in `rejected` and the next one is considered.
Times are seconds on `clock` since the source was made; each request's arrival, admission, first token and finish
are kept in `timeline` (the first token: its prompt's logits exist, the token is chosen in the same loop turn)."""
from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvbench.serving.pool import KVPool

ARRIVALS = ("burst", "poisson", "concurrency")


@dataclass(frozen=True)
class Arrival:
    """An arrival process: `kind` in ARRIVALS; `rate` (poisson, requests/s) or `concurrency` (clients)."""

    kind: str = "burst"
    rate: float | None = None
    concurrency: int | None = None
    seed: int = 0

    def __post_init__(self):
        if self.kind not in ARRIVALS:
            raise ValueError(f"serving: arrival={self.kind!r} is not one of {', '.join(ARRIVALS)}")
        if self.kind == "poisson" and not (self.rate and self.rate > 0):
            raise ValueError(f"serving: arrival=poisson needs serving.rate > 0 (requests/s), got {self.rate}")
        if self.kind == "concurrency" and not (self.concurrency and self.concurrency >= 1):
            raise ValueError(f"serving: arrival=concurrency needs serving.concurrency >= 1, got {self.concurrency}")

    @property
    def tag(self) -> str:
        """A folder-name part: burst, poisson2.0, conc4."""
        return {"burst": "burst", "poisson": f"poisson{self.rate}", "concurrency": f"conc{self.concurrency}"}[self.kind]

    def times(self, n: int) -> list[float | None]:
        """Arrival times of `n` requests (None: on a finish, for a closed loop's requests past its first clients)."""
        if self.kind == "burst":
            return [0.0] * n
        if self.kind == "concurrency":
            return [0.0 if i < self.concurrency else None for i in range(n)]
        rng, t, out = random.Random(self.seed), 0.0, []
        for _ in range(n):
            out.append(t)
            t += rng.expovariate(self.rate)
        return out


@dataclass
class Timeline:
    arrival_s: float | None = None
    admit_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    reserved_bytes: int = 0
    running: int = 0  # requests running once it joined, itself included


class PoolSource:
    """Requests with arrival times, admitted under a KV pool (the engine polls it; see the module docstring)."""

    def __init__(self, requests: Sequence, reserved_bytes: Sequence[int], pool: KVPool, arrival: Arrival,
                 clock: Callable[[], float] = time.perf_counter):
        self.pool, self.arrival, self._clock, self._t0 = pool, arrival, clock, clock()
        self.timeline = {id(r): Timeline(reserved_bytes=b) for r, b in zip(requests, reserved_bytes)}
        self.scheduled = deque(zip(arrival.times(len(requests)), requests))
        self.waiting: deque = deque()
        self.rejected: list = []
        self.in_system = 0  # arrived and not finished (the closed loop's clients)

    def now(self) -> float:
        return self._clock() - self._t0

    def of(self, request) -> Timeline:
        return self.timeline[id(request)]

    def _arrive(self, now: float) -> None:
        while self.scheduled:
            at, request = self.scheduled[0]
            if at is None:  # a closed loop's next request: when one of its clients is free
                if self.in_system >= self.arrival.concurrency:
                    return
                at = now
            elif at > now:
                return
            self.scheduled.popleft()
            self.of(request).arrival_s = at
            self.waiting.append(request)
            self.in_system += 1

    def poll(self, active) -> object | None:
        now = self.now()
        self._arrive(now)
        while self.waiting:
            request = self.waiting[0]
            need = self.of(request).reserved_bytes
            if need > self.pool.capacity_bytes:  # never fits: set aside, the next one may
                self.waiting.popleft()
                self.rejected.append(request)
                self.in_system -= 1
                continue
            if not self.pool.reserve(need):
                return None
            self.waiting.popleft()
            self.of(request).admit_s = now
            return request
        return None

    def wait(self) -> bool:
        """Nothing runs: sleep until the next arrival; False once every request has come and gone."""
        if self.waiting:
            return True  # (the pool is empty now, so the oldest fits on the next poll)
        if not self.scheduled:
            return False
        at = self.scheduled[0][0]
        if at is not None:
            time.sleep(max(0.0, at - self.now()))
        return True

    def joined(self, slot, running: int) -> None:
        timeline = self.of(slot.request)
        timeline.first_token_s, timeline.running = self.now(), running

    def finished(self, request) -> Timeline:
        """The request left (done or failed): its bytes go back to the pool."""
        timeline = self.of(request)
        timeline.finish_s = self.now()
        self.pool.release(timeline.reserved_bytes)
        self.in_system -= 1
        return timeline
