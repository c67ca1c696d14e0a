"""Attention math shared by the engine, the capture (models/) and the evictors (methods/): one decode attention over
every sequence's cache of a layer (`decode`) and the column sums of a row score over causal logits (`columns`).
It reads what a cache layer hands over (`kvbench.cache.kv_cache.DecodeKV`) and knows nothing above it."""
