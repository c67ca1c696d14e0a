"""kvbench: a reproducible benchmark harness for KV-cache compression."""

__version__ = "0.1.0"
