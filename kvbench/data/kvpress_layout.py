"""kvpress's prompt layout (NVIDIA/kvpress @ 8bb29b9, `kvpress/pipeline.py: KVPressTextGenerationPipeline.preprocess`),
shared by the `protocol=kvpress` readings of LongBench v2, ZeroSCROLLS and LooGLE.

kvpress stores each row as `context`, `question` and `answer_prefix` and builds the ids in two pieces, each tokenized
on its own with no special tokens added:
- with a chat template: the user turn holds `context + question`; the context piece is the rendered text up to the
  end of the context, the question piece is `question` + the template's tail (end of turn, assistant header) +
  `answer_prefix` (so the answer prefix opens the assistant turn);
- without one: the context piece is `bos_token + context`, the question piece `question + "\\n" + answer_prefix`.
The context piece is cut to its first `max_context_tokens` tokens (kvpress's `max_context_length`; kvbench passes the
model's `max_prompt_tokens`). The context piece is what `query=agnostic` compresses before the question, as kvpress's
pipeline does.
"""
from __future__ import annotations

from typing import NamedTuple


class Layout(NamedTuple):
    text: str                # what the model reads (context piece + question piece, before any cut)
    ids: tuple[int, ...]     # context ids (cut) + question ids
    context_tokens: int      # how many of `ids` are context
    context_chars: int       # where the context piece ends in `text`
    truncated: bool


def kvpress_layout(tokenizer, context: str, question: str, answer_prefix: str, chat_template: bool,
                   max_context_tokens: int | None = None, chat_kwargs: dict | None = None) -> Layout:
    """The ids kvpress's pipeline runs for one (context, question) row (see the module docstring)."""
    if chat_template:
        separator = "#" * (len(context) + 10)  # kvpress's marker: longer than any run of '#' in the context
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": context + separator}], tokenize=False,
                                                 add_generation_prompt=True, **(chat_kwargs or {}))
        context_text, tail = rendered.split(separator)
    else:
        context_text, tail = (getattr(tokenizer, "bos_token", None) or "") + context, "\n"
    question_text = question + tail + answer_prefix
    context_ids = tokenizer.encode(context_text, add_special_tokens=False)
    question_ids = tokenizer.encode(question_text, add_special_tokens=False)
    truncated = max_context_tokens is not None and len(context_ids) > max_context_tokens
    if truncated:
        context_ids = context_ids[:max_context_tokens]
    return Layout(context_text + question_text, tuple(context_ids + question_ids), len(context_ids), len(context_text),
                  truncated)
