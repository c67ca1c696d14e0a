"""Benchmark builders. Each yields plain `Sample` records; importing this package registers the built-in ones."""
from kvbench.data import (  # noqa: F401  (registration)
    gsm8k, infinitebench, latency, longbench, longbench_v2, loogle, lost_in_the_middle, niah, niah_multiturn,
    reasoning, ruler, scbench, summarization, wikitext, zero_scrolls,
)
from kvbench.data.base import Dataset, Sample

__all__ = ["Dataset", "Sample"]
