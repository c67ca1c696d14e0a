"""A run against an external OpenAI-compatible server (vLLM, SGLang, TensorRT-LLM, llama.cpp's server, or
`python -m kvbench.serve`): `model=openai model.base_url=... model.name=...` (docs/serving.md#client).

spec.py is the model node (where the server is, where prompts are tokenized, how they are sent) and what such a run
refuses; wire.py is the OpenAI wire format (request bodies, SSE chunks); client.py sends requests concurrently with
async httpx, streaming, and times each one (time to first token, per output token, end to end); it is also the
load benchmark's way to drive a server (`replay`). The run loop that turns replies into records is
kvbench.runs.remote."""
