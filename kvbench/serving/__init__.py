"""Serving figures at a fixed KV memory pool: requests of any kvbench dataset replayed into the engine's continuous
batching with an arrival process, each admitted when its KV fits the pool (docs/serving.md).

    python -m kvbench.serving method=full,snapkv budget=128 dataset=niah limit=8 serving.pool_requests=2

pool.py says what a request may hold and keeps the pool's account; arrivals.py is when requests come and which may
join now (the engine's `Source`); bench.py drives the engine and writes one record per request; figures.py turns
records into throughput, goodput, latency percentiles and accuracy; plots.py draws the Pareto front and latency CDFs.
remote_load.py sends the same requests to an external server instead (`model=openai`, through kvbench.remote's
client): the pool is the server's, the timings the client's.

The OpenAI-compatible server (`python -m kvbench.serve method=snapkv budget=256 serve.port=8000`) admits by the same
pool: serve_spec.py is its command line, scheduler.py the decoder thread fed by the HTTP handlers, wire.py OpenAI's
bodies, server.py the FastAPI app."""
