"""kvbench: a reproducible benchmark harness for KV-cache compression.

`from kvbench import RunSpec, Engine` is the Python API (kvbench/runs/api.py); it is imported on first use, so
`import kvbench` stays light and the package's leaf floor imports nothing above it."""

__version__ = "0.1.0"

_API = ("RunSpec", "Run", "Engine")


def __getattr__(name: str):
    if name in _API:
        import importlib

        return getattr(importlib.import_module("kvbench.runs.api"), name)
    raise AttributeError(f"module 'kvbench' has no attribute {name!r}")
