"""The OpenAI wire format, as far as a benchmark needs it: a completion request's body, and what a streamed reply's
server-sent events say (text pieces, the finish reason, usage, and any server-specific object such as kvbench's own
`kvbench`). Plain functions, no I/O: client.py does the sending."""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

CHOICE_FIELDS = ("index", "text", "delta", "message", "logprobs", "finish_reason", "stop_reason")  # OpenAI's, vLLM's
FINISH_TO_STOP = {"stop": "stop", "length": "max_new_tokens", "eos": "eos"}  # the record's `stop_reason` names


def completion_body(model: str, prompt: str | Sequence[int], max_tokens: int, stop: Sequence[str] = (),
                    stop_token_ids: Sequence[int] = (), min_tokens: int = 0, sampling=None,
                    seed: int | None = None) -> dict:
    """A streamed /v1/completions request. `prompt`: text, or token ids (sent as one list of ints, which vLLM,
    SGLang, TensorRT-LLM's and llama.cpp's servers accept). Fields outside OpenAI's own (`stop_token_ids`,
    `min_tokens`, `top_k`) are sent only when they change something, so a strict server never sees them otherwise.
    `sampling`: the run's `kvbench.engine.generation.Sampling` (None: greedy)."""
    sampled = sampling is not None and sampling.do_sample
    body = {"model": model, "prompt": prompt if isinstance(prompt, str) else list(prompt), "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True},
            "temperature": sampling.temperature if sampled else 0.0}
    if sampled and sampling.top_p < 1.0:
        body["top_p"] = sampling.top_p
    if sampled and sampling.top_k > 0:
        body["top_k"] = sampling.top_k
    if sampled and seed is not None:
        body["seed"] = seed
    if stop:
        body["stop"] = list(stop)
    if stop_token_ids:
        body["stop_token_ids"] = list(stop_token_ids)
    if min_tokens:
        body["min_tokens"] = min_tokens
    return body


@dataclass
class Reply:
    """What a streamed reply has said so far: its text pieces (one per chunk that carried text), the finish
    reason, usage, and any extra object the server added, at the top or in the choice (kvbench's server: `kvbench`,
    its last value kept)."""

    pieces: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None
    extra: dict = field(default_factory=dict)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def take(self, chunk: dict) -> bool:
        """Read one chunk; True if it carried text (the first such chunk is the first token)."""
        if "error" in chunk:
            raise ServerError(str(chunk["error"].get("message", chunk["error"]) if isinstance(chunk["error"], dict)
                                  else chunk["error"]))
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for key, value in chunk.items():
            if key not in ("id", "object", "created", "model", "choices", "usage", "system_fingerprint"):
                self.extra[key] = value
        texted = False
        for choice in chunk.get("choices") or []:
            for key, value in choice.items():  # a per-choice extension (kvbench's server puts `kvbench` here)
                if key not in CHOICE_FIELDS and value is not None:
                    self.extra[key] = value
            piece = choice.get("text")
            if piece is None:  # a chat chunk
                piece = (choice.get("delta") or {}).get("content")
            if piece:
                self.pieces.append(piece)
                texted = True
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return texted


class ServerError(RuntimeError):
    """The server said no (an HTTP error status, or an `error` object in the stream)."""


def sse_data(line: str) -> dict | None | str:
    """One line of a server-sent event stream: its JSON payload, "[DONE]", or None for anything else (comments,
    blank lines, `event:` / `id:` fields)."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return data
    try:
        return json.loads(data)
    except ValueError:
        raise ServerError(f"not a JSON event in the stream: {data[:200]!r}") from None
