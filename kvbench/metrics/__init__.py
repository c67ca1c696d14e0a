"""Scorers, registered by name in `kvbench.registry.METRICS`: `fn(prediction, references) -> float`.

Each function's docstring names the reference implementation it matches. Importing this package registers all of
them, so `METRICS[name]` works after `import kvbench.metrics`. `kvbench.metrics.stats` gives each score its
uncertainty (standard errors, seeded bootstrap intervals): datasets, the run store and the report use it.
"""
from kvbench.metrics import longbench, niah, qa, reasoning, ruler, summarization  # noqa: F401  (registers the scorers)
from kvbench.registry import METRICS

__all__ = ["METRICS"]
