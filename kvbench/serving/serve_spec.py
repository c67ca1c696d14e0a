"""The server's command line (`python -m kvbench.serve <run overrides> serve.<name>=...`), checked whole before any
weights load: the run through `RunSpec` (every check `python -m kvbench.run` makes), the server's own settings
(`ServeSpec`), what a server needs of the run (a KV bound the pool admits by), and the address it will listen on."""
from __future__ import annotations

import dataclasses
import socket
from dataclasses import dataclass

import yaml

from kvbench.runs.api import Run, RunSpec
from kvbench.serving.pool import KVPool, check_bounded

RUN_KEYS = ("method", "budget", "ratio", "model", "dataset")  # RunSpec's own fields on the command line


@dataclass(frozen=True)
class ServeSpec:
    """The server's own settings (`serve.<field>=` on the command line)."""

    host: str = "127.0.0.1"
    port: int = 8000
    pool_bytes: int | None = None  # the KV pool; or instead:
    pool_requests: float | None = None  # a pool of this many full-cache requests of the longest allowed
    #                                     (neither set: max_batch of them)
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
            serve_values[name] = text
        elif key == "batch_size":
            raise ValueError("serve: the batch is serve.max_batch (the most requests decoding at once); drop "
                             "batch_size")
        elif key in RUN_KEYS:
            run_values[key] = yaml.safe_load(text)
        else:
            overrides.append(arg)
    serve = ServeSpec(**{name: typed(name, fields[name].type, value) for name, value in serve_values.items()})
    return RunSpec(**run_values, batch_size=serve.max_batch, overrides=tuple(overrides)), serve


def typed(name: str, annotation: str, text: str):
    """A `serve.<name>=` value as its field's type (`int`, `float`, `str`, or None where the field allows it)."""
    if annotation.startswith("str"):
        return text
    value = yaml.safe_load(text)
    if value is None and "None" in annotation:
        return None
    if annotation.startswith("int") and isinstance(value, int) and not isinstance(value, bool):
        return value
    if annotation.startswith("float") and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise ValueError(f"serve: {name}={text!r} must be {'an integer' if annotation.startswith('int') else 'a number'}")


def check_servable(run: Run) -> None:
    """What the server needs of a run, before weights load: a KV bound to admit by, one sequence per request."""
    from kvbench.runs.config import decode_compression

    check_bounded(run.method, decode_compression(run.cfg).on)
    if run.cfg.generation.get("num_beams", 1) > 1:
        raise ValueError("serve: requests decode greedily or by sampling, not by beam search; use "
                         "generation.num_beams=1")
    if run.cfg.get("query", "aware") != "aware":
        raise ValueError("serve: a request's prompt is prefilled whole, then compressed; use query=aware")


def check_port(host: str, port: int) -> None:
    """Refuse, before weights load, an address this process cannot listen on (in use, or not this machine's)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as uvicorn binds)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(f"serve: cannot listen on {host}:{port} ({e.strerror or e}); pick another serve.port "
                             "or serve.host") from None


def pool_of(serve: ServeSpec, max_prompt_tokens: int, entry_bytes: int) -> KVPool:
    """`serve.pool_bytes`, or `pool_requests` (default: max_batch) full-cache requests of the longest allowed."""
    if serve.pool_bytes is not None:
        return KVPool(serve.pool_bytes)
    n = serve.pool_requests if serve.pool_requests is not None else serve.max_batch
    return KVPool(int(n * (max_prompt_tokens + serve.max_tokens) * entry_bytes))
