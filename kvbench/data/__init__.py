"""Benchmark builders. Each yields plain `Sample` records; importing a module registers its builder."""
from kvbench.data.base import Sample

__all__ = ["Sample"]
