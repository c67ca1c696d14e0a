"""Benchmark builders. Each yields plain `Sample` records; importing this package registers the built-in ones."""
from kvbench.data import longbench, niah, ruler  # noqa: F401  (registration)
from kvbench.data.base import Dataset, Sample

__all__ = ["Dataset", "Sample"]
