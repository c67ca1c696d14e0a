"""Where a prompt's context ends and its question begins (`query=agnostic`: compress the context alone).

Every benchmark with a question declares the split on its own prompt template: the context part is the template up
to its context field (and the whitespace after it, or up to a declared boundary), the question part is the rest, so
the two parts joined are the template byte for byte and a split prompt is exactly today's prompt (kvpress's LongBench
context/question templates split at the same place). The runner then finds the first question token in the token
ids it runs (`context_token_count`): the ids do not change with the mode, only where compression happens.
"""
from __future__ import annotations

import re


def split_template(template: str, field: str = "context", boundary: str | None = None) -> tuple[str, str]:
    """`(context part, question part)` of `template`, joined exactly `template`. The question part starts at the
    first occurrence of `boundary` after `{field}`, or (no boundary, or not found) right after `{field}` and the
    whitespace that follows it. An empty question part means the prompt has no question."""
    mark = "{" + field + "}"
    if mark not in template:
        raise ValueError(f"split_template: the template has no {mark} field")
    at = template.index(mark) + len(mark)
    found = template.find(boundary, at) if boundary else -1
    if found >= 0:
        at = found
    else:
        while at < len(template) and template[at].isspace():
            at += 1
    return template[:at], template[at:]


def question_offset(text: str, question_template: str) -> int | None:
    """Where the question part of `question_template` (fields in braces, filled with anything) starts in `text`,
    which must end with it: the last occurrence of its first literal piece from which the whole part matches to the
    end (few-shot examples that repeat the question earlier are skipped). None if `text` does not end with it."""
    pieces = re.split(r"\{\w+\}", question_template)
    pattern = re.compile("(?s)" + "(.*?)".join(re.escape(p) for p in pieces) + r"\Z")
    head = pieces[0]
    at = text.rfind(head) if head else len(text)
    while at >= 0:
        if pattern.match(text, at):
            return at
        at = text.rfind(head, 0, at) if head else -1
    return None


def suffix_offset(text: str, question: str) -> int | None:
    """Where the question text `question` starts in `text`, which must end with it (None otherwise)."""
    return len(text) - len(question) if question and text.endswith(question) else None


def content_offset(rendered: str, content: str) -> int:
    """Where a user turn's `content` sits inside a chat-rendered prompt (the split happens inside the user turn)."""
    at = rendered.rfind(content)
    if at < 0:
        raise ValueError("query=agnostic: the chat template does not contain the prompt verbatim; cannot split it")
    return at


def context_token_count(tokenizer, text: str, char_end: int, ids: list[int], **encode_kwargs) -> int:
    """The number of leading `ids` (the tokens of `text`) that hold only context, i.e. lie before character
    `char_end`: the longest common prefix of `ids` and the tokens of `text[:char_end]` (same `encode_kwargs`). A
    token that straddles the boundary belongs to the question. Works for any tokenizer (no offset mapping needed)."""
    prefix = tokenizer(text[:char_end], **encode_kwargs).input_ids
    n = 0
    for a, b in zip(prefix, ids):
        if a != b:
            break
        n += 1
    return n


def cut_context(n_context: int, n_before: int, n_after: int, half: int) -> int:
    """The context token count after a middle cut kept the first `half` and the last tokens of `n_before` tokens
    (`n_after` remain): a split in the kept tail moves left by what was cut; a split inside the cut falls at it."""
    if n_before == n_after or n_context <= half:
        return n_context
    return max(half, n_context - (n_before - n_after))
