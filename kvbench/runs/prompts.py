"""A sample's prompt as the model reads it: its text rendered (chat template or plain) and its token ids, middle-cut to
the model's `max_prompt_tokens`. Shared by the command line's sample loop, the grid, and the Python API's engine
(kvbench.runs.api), so a prompt is the same token ids whichever door it came through."""
from __future__ import annotations


def render(tokenizer, prompt: str, spec, chat_kwargs=None) -> tuple[str, dict]:
    """The text the model reads (the user turn of its chat template, or the prompt) and how it is tokenized.
    `chat_kwargs` (a sample's `chat_template_kwargs`, e.g. `enable_thinking`) go to the template."""
    if spec.chat_template:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                               add_generation_prompt=True, **(chat_kwargs or {}))
        return prompt, {"add_special_tokens": False}
    return prompt, {}


def encode(tokenizer, prompt: str, spec) -> list[int]:
    text, kwargs = render(tokenizer, prompt, spec)
    return tokenizer(text, **kwargs).input_ids


def prompt_ids(sample, tokenizer, spec) -> list[int]:
    """The token ids a sample runs with: the builder's own (benchmark truncation) or the model's policy, middle-cut."""
    return prompt_split(sample, tokenizer, spec, split=False)[0]


def prompt_split(sample, tokenizer, spec, split: bool = True) -> tuple[list[int], int | None]:
    """`prompt_ids` and how many of them are context (None: no question, or `split` false). With a chat template
    the split falls inside the rendered user turn: the template's tail (end of turn, assistant header) is part of
    the question (`kvbench.data.split`)."""
    if sample.input_ids is not None:  # the builder applied its benchmark's own truncation rule
        return list(sample.input_ids), sample.context_tokens if split else None
    from kvbench.data.split import content_offset, context_token_count, cut_context

    text, kwargs = render(tokenizer, sample.prompt, spec, sample.chat_template_kwargs)
    ids = tokenizer(text, **kwargs).input_ids
    n_context = None
    if split and sample.context_end is not None:
        at = content_offset(text, sample.prompt) + sample.context_end
        n_context = context_token_count(tokenizer, text, at, ids, **kwargs)
    if len(ids) > spec.max_prompt_tokens:  # middle truncation in tokens
        half, n_full = spec.max_prompt_tokens // 2, len(ids)
        ids = ids[:half] + ids[-half:]
        n_context = cut_context(n_context, n_full, len(ids), half) if n_context is not None else None
    return ids, n_context
