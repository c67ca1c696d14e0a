"""The OpenAI wire format the server speaks: request bodies (pydantic), which of their knobs kvbench's engine can
honour (the others: a 400 that says why), response bodies and stream chunks, and the streamed text of a request.

What is honoured: `max_tokens`, `stop`, `temperature` (0: greedy; > 0: sampled with `top_p`, `top_k`, `seed`),
`stream` (+ `stream_options.include_usage`), and vLLM's `min_tokens` / `ignore_eos`. Unknown fields are ignored, as
OpenAI's clients send their own; fields the engine cannot honour (`n` > 1, `logprobs`, `echo`, penalties, logit bias,
tools) are refused rather than silently dropped. Each choice carries a `kvbench` object (the request's KV bytes
after compression, before it, at the end, its budget, reservation and server-side latencies), which clients ignore."""
from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kvbench.engine.generation import Sampling
from kvbench.serving.scheduler import Refused

FINISH_REASONS = {"eos": "stop", "stop": "stop", "max_new_tokens": "length"}


class StreamOptions(BaseModel):
    include_usage: bool = False


class Knobs(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="allow")  # clients send fields of their own (user, metadata): ignored

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # vLLM's extension; -1 and 0: off
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    min_tokens: int = Field(0, ge=0)  # vLLM's extension: no EOS or stop token before this many
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens tokens
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None

    def stops(self) -> tuple[str, ...]:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(s == "" for s in stops):
            raise Refused("stop: an empty stop string would end every reply at once; remove it", param="stop")
        return stops

    def refuse_unsupported(self) -> None:
        """The knobs kvbench's engine cannot honour, each refused in one line that says why."""
        if self.n != 1:
            raise Refused(f"n={self.n}: this server returns one choice per prompt; send the prompt n times (with "
                          "different seeds when sampling)", param="n")
        if self.presence_penalty or self.frequency_penalty:
            raise Refused("presence_penalty / frequency_penalty: kvbench's sampling has no penalties; leave them 0",
                          param="presence_penalty" if self.presence_penalty else "frequency_penalty")
        if self.logit_bias:
            raise Refused("logit_bias: kvbench's sampling takes no bias; leave it out", param="logit_bias")


class CompletionRequest(Knobs):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo or self.logprobs is not None:
            raise Refused("echo / logprobs: this server generates text and does not score prompts (lm-eval's "
                          "loglikelihood tasks); run those in-process with `python -m kvbench.harness`",
                          param="logprobs" if self.logprobs is not None else "echo")
        if self.best_of not in (None, 1):
            raise Refused(f"best_of={self.best_of}: one generation per prompt; leave best_of out", param="best_of")
        if self.suffix:
            raise Refused("suffix: insertion (fill-in-the-middle) is not served; leave suffix out", param="suffix")

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request: one text or list of token ids, or a list of either (one choice each)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise Refused("prompt is empty; send a string, a list of token ids, or a list of either", param="prompt")
        return list(p)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.type != "text" or part.text is None for part in self.content):
            raise Refused("messages: only text content parts are served (this engine reads text only)",
                          param="messages")
        return "".join(part.text for part in self.content)


class ChatRequest(Knobs):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list | None = None
    response_format: dict | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.logprobs or self.top_logprobs:
            raise Refused("logprobs: this server does not return token log-probabilities; leave logprobs out",
                          param="logprobs")
        if self.tools:
            raise Refused("tools: tool calls are not served; leave tools out", param="tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise Refused("response_format: only plain text is served (no JSON mode or schema)",
                          param="response_format")

    def dialogue(self) -> list[dict]:
        """The messages as the chat template takes them (`developer` is a system turn)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


def sampling_of(knobs: Knobs, base: Sampling) -> Sampling | None:
    """The request's token rule: None (the run's, `base`) unless it sets temperature; 0 is greedy. top_p / top_k
    without a temperature on a greedy run cannot be honoured: refused."""
    if knobs.temperature is None:
        if (knobs.top_p not in (None, 1.0) or knobs.top_k not in (None, 0, -1)) and not base.do_sample:
            raise Refused("top_p / top_k: this server decodes greedily unless a request sets temperature > 0; set "
                          "temperature too (or start it with generation.do_sample=true)", param="temperature")
        if knobs.seed is None or not base.do_sample:
            return None
        return Sampling(True, base.temperature, base.top_k, base.top_p, knobs.seed)
    if knobs.temperature == 0.0:
        return Sampling()
    top_k = knobs.top_k if knobs.top_k not in (None, -1) else 0
    return Sampling(True, knobs.temperature, top_k, 1.0 if knobs.top_p is None else knobs.top_p,
                    base.seed if knobs.seed is None else knobs.seed)


# --- responses ---------------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def finish_reason(outcome) -> str:
    return FINISH_REASONS.get(outcome.stop_reason, "stop")


def kvbench_fields(job, outcome) -> dict:
    """The kvbench extension of a choice: KV bytes, budget, reservation and the server-side latencies."""
    t = job.timeline
    fields = {"kv_bytes": outcome.kv_bytes, "full_kv_bytes": outcome.full_kv_bytes,
              "kv_bytes_final": outcome.kv_bytes_final, "peak_kv_bytes": outcome.peak_kv_bytes,
              "budget": job.request.budget, "reserved_bytes": job.reserved_bytes, "prompt_tokens": outcome.prompt_len}
    if t is not None and None not in (t.arrival_s, t.admit_s, t.first_token_s, t.finish_s):
        fields.update(queue_s=t.admit_s - t.arrival_s, ttft_s=t.first_token_s - t.arrival_s,
                      e2e_s=t.finish_s - t.arrival_s, running=t.running)
    return fields


def completion_choice(chat: bool, index: int, text: str, finish: str | None, extra: dict | None = None) -> dict:
    body = {"index": index, "message": {"role": "assistant", "content": text}} if chat else \
        {"index": index, "text": text}
    body.update(logprobs=None, finish_reason=finish)
    if extra is not None:
        body["kvbench"] = extra
    return body


def chunk_choice(chat: bool, index: int, text: str | None, finish: str | None, first: bool = False,
                 extra: dict | None = None) -> dict:
    if chat:
        delta = {"role": "assistant", "content": ""} if first else {} if text is None else {"content": text}
        body = {"index": index, "delta": delta}
    else:
        body = {"index": index, "text": text or ""}
    body.update(logprobs=None, finish_reason=finish)
    if extra is not None:
        body["kvbench"] = extra
    return body


def envelope(chat: bool, chunk: bool, rid: str, model: str, choices: list[dict], usage: dict | None = None,
             created: int | None = None) -> dict:
    obj = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    body = {"id": rid, "object": obj, "created": created or int(time.time()), "model": model, "choices": choices}
    if usage is not None or not chunk:
        body["usage"] = usage
    return body


def usage_of(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class TextStream:
    """A reply's text as its tokens come: each step's new text, held back where it may still change (an unfinished
    UTF-8 character, the start of a stop string), and cut at a stop string as the engine cuts it. `final` adds
    what the finished reply holds beyond what was sent, so the pieces join into the non-streamed text."""

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.tokenizer, self.stops = tokenizer, stops
        self.tokens: list[int] = []
        self.sent = ""

    def push(self, tokens: list[int]) -> str:
        self.tokens += tokens
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        cut = min((text.find(s) for s in self.stops if s in text), default=-1)
        if cut >= 0:
            text = text[:cut]
        else:
            text = text[:len(text) - self._held(text)]
        return self._advance(text.rstrip("\ufffd"))

    def final(self, text: str) -> str:
        return self._advance(text)

    def _held(self, text: str) -> int:
        """How many trailing characters may begin a stop string."""
        return max((n for s in self.stops for n in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:n])), default=0)

    def _advance(self, text: str) -> str:
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""  # (a decode that rewrote earlier text: the rest comes with `final`, where it agrees)
        piece, self.sent = text[len(self.sent):], text
        return piece
