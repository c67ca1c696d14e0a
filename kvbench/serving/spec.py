"""The load benchmark's settings: `ServingSpec`, read from configs/serving/ (default.yaml, or a preset beside it)
with the command line's `serving.<field>=` on top, each value checked by kvbench/runs/schema.py's rules and the
relations between them by `__post_init__`: one line on bad input, before any weights load."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvbench.serving.arrivals import Arrival

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "serving"


@dataclass(frozen=True)
class ServingSpec:
    """A load benchmark's own settings (configs/serving/default.yaml says what each one is)."""

    pool_bytes: int | None = None  # the KV pool; or instead:
    pool_requests: float | None = None  # a pool holding this many full-cache requests of the longest prompt
    arrival: Literal["burst", "poisson", "concurrency"] = "burst"  # kvbench.serving.arrivals
    rate: float | None = None  # poisson: requests/s
    concurrency: int | None = None  # concurrency: clients in a closed loop
    seed: int = 0  # poisson's gaps
    max_batch: int = 64  # the most requests decoding at once, whatever the pool allows
    ttft_slo_s: float | None = None  # goodput's latency targets (None: no target)
    tpot_slo_s: float | None = None
    limit: int | None = None  # the dataset's first N samples
    ignore_eos: bool = False  # every request decodes its max_new_tokens (EOS and stop tokens held off until then)
    results_dir: str = "results"

    def __post_init__(self):
        if (self.pool_bytes is None) == (self.pool_requests is None):
            raise ValueError("serving: set one of serving.pool_bytes (bytes) or serving.pool_requests (full-cache "
                             "requests of the longest prompt the pool holds)")
        if self.pool_requests is not None and self.pool_requests <= 0:
            raise ValueError(f"serving: pool_requests={self.pool_requests} must be > 0")
        if self.max_batch < 1:
            raise ValueError(f"serving: max_batch={self.max_batch} must be >= 1")
        self.process  # noqa: B018 - the arrival's own checks

    @property
    def process(self) -> Arrival:
        return Arrival(self.arrival, self.rate, self.concurrency, self.seed)

    @property
    def slo_s(self) -> tuple[float, float]:
        """(TTFT target, TPOT target) in seconds; infinity where none is set."""
        return tuple(float("inf") if s is None else s for s in (self.ttft_slo_s, self.tpot_slo_s))

    @classmethod
    def from_config(cls, node: Mapping[str, Any]) -> ServingSpec:
        """A `serving` node (configs/serving/<preset>.yaml with overrides merged), each value checked against its
        rule (`serving.<field>=<value> must be ...`), unknown keys named with the valid ones."""
        from omegaconf import DictConfig, OmegaConf

        from kvbench.runs.rules import problem_line
        from kvbench.runs.schema import rules_of

        values = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
        rules = rules_of(cls)
        for key, value in values.items():
            if key not in rules:
                raise ValueError(f"serving: no setting {key!r}; valid: {', '.join(sorted(rules))}")
            line = problem_line(f"serving.{key}", value, rules[key]) if rules[key] is not None else None
            if line is not None:
                raise ValueError(f"serving: {line}")
        return cls(**values)


@dataclass(frozen=True)
class RemoteServingSpec(ServingSpec):
    """The same settings for a load run against a server (`model=openai`, kvbench.serving.remote_load): the KV pool
    and the batch are the server's, set where it starts, so `pool_bytes`, `pool_requests` and `max_batch` are
    refused here rather than silently ignored."""

    def __post_init__(self):
        for name in SERVERS_SETTINGS:
            value, default = getattr(self, name), ServingSpec.__dataclass_fields__[name].default
            if value != default:
                raise ValueError(f"serving: serving.{name}={value} with model=openai: the KV pool and the batch are "
                                 f"the server's (set them where it starts, e.g. python -m kvbench.serve "
                                 f"serve.{name}=...); drop serving.{name}")
        self.process  # noqa: B018 - the arrival's own checks


SERVERS_SETTINGS = ("pool_bytes", "pool_requests", "max_batch")  # a server's own, never the client's


def presets() -> list[str]:
    """The files of configs/serving/ (`serving=<name>` on the command line)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def serving_node(preset: str = "default", overrides: Mapping[str, Any] | None = None):
    """configs/serving/<preset>.yaml with `overrides` (field -> value) on top, as a DictConfig."""
    from omegaconf import OmegaConf

    from kvbench.registry import unknown_choice

    if preset not in (names := presets()):
        raise ValueError(unknown_choice("serving preset", preset, names))
    node = OmegaConf.load(CONFIG_DIR / f"{preset}.yaml")
    return OmegaConf.merge(node, dict(overrides or {}))


FIELDS = tuple(f.name for f in dataclasses.fields(ServingSpec))
