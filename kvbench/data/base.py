"""The one record type every benchmark builder yields, the builder interface, and the hash of a sample's text."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping


@dataclass(frozen=True)
class Sample:
    """One prompt to run. `prompt` is final text (template applied); `answers` are the references for scoring.

    `stop` holds stop strings (generation ends when one appears; the prediction is cut before it).
    `meta` carries benchmark-specific fields the scorer or the report needs (e.g. NIAH context_length, depth_percent;
    multi-task benchmarks put the task name in `meta["task"]`).
    `input_ids`, when a builder sets it, is the exact token sequence to run (the builder applied its own truncation
    and chat-template rules, as LongBench's must); otherwise the runner tokenizes `prompt` with the model's policy.
    `stop_token_ids` end generation at a token (excluded from the prediction), as HF's extra `eos_token_id`s do;
    `min_new_tokens` forbids EOS and those tokens before that many new tokens (HF's `min_length`).
    `context_end` (characters of `prompt`) and, with `input_ids`, `context_tokens` (how many of them) say where the
    context ends and the question begins (`query=agnostic` compresses the context before the question is fed;
    `kvbench.data.split`); None: the prompt has no question, and both modes are the same run.
    `chat_template_kwargs` go to `apply_chat_template` when the runner renders `prompt` in the model's chat template
    (`model.chat_template: true`), e.g. `{"enable_thinking": False}` for Qwen3's thinking switch.
    """

    id: str
    prompt: str
    answers: list[str]
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)
    input_ids: tuple[int, ...] | None = None
    stop_token_ids: tuple[int, ...] = ()
    min_new_tokens: int = 0
    context_end: int | None = None
    context_tokens: int | None = None
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)


def sha256_text(text: str) -> str:
    """Hex sha256 of a sample's text: a record's `prompt_sha256`, a manifest's `data_sha256` (every id and prompt),
    the per-sample seed (its id)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class Dataset:
    """A benchmark builder: a dataclass (built from `configs/dataset/<name>.yaml` by `_target_`) that turns a
    tokenizer into samples and scores predictions. Subclasses register with `@DATASETS.register("<name>")`.

    `version` goes into every manifest; bump it whenever prompts, lengths or scoring change.
    """

    version: str = "0"
    primary_metric: str = ""
    # scores that are not means over samples (name -> kvbench.metrics.stats.CorpusMetric, e.g. BUZZ's geometric-mean
    # ROUGE): scores.json gets their value and a seeded bootstrap se; per-sample metrics get sd / sqrt(n) without asking
    corpus_metrics: ClassVar[Mapping] = {}

    def build(self, tokenizer, max_prompt_tokens: int, chat_template: bool = False) -> list[Sample]:
        """Samples for this tokenizer. `chat_template` is the model config's policy; builders that set
        `Sample.input_ids` apply it themselves (with their benchmark's exceptions), others may ignore it."""
        raise NotImplementedError  # pragma: no cover - interface

    def score(self, sample: Sample, prediction: str) -> dict[str, float]:  # pragma: no cover - interface
        raise NotImplementedError

    # True where a sample's scored answer comes from a second question whose text depends on the first reply
    # (`follow_up`): the runner then asks it as a new request once the first reply is done (kvbench.runs.follow_up)
    asks_follow_up: bool = False

    def follow_up(self, sample: Sample, reply: str, tokenizer, max_prompt_tokens: int | None,
                  chat_template: bool) -> Sample:
        """The second question after `reply` (the first generation's text), with its own token ids
        (`Sample.input_ids`) and limits; it is scored as the sample's answer. Only where `asks_follow_up`."""
        raise NotImplementedError  # pragma: no cover - interface

    def summarize(self, records: list[dict]) -> dict:
        """Benchmark-specific aggregates merged into scores.json (e.g. per-task scores and the paper's average).
        Default: nothing beyond the per-metric means every run gets."""
        return {}


def middle_cut(ids: list[int], limit: int) -> list[int]:
    """Keep the first and last `limit // 2` ids of a sequence longer than `limit` (the long-context benchmarks'
    middle truncation: InfiniteBench, SCBench's `truncate_input`); a negative limit cuts nothing."""
    if limit < 0 or len(ids) <= limit:
        return ids
    half = limit // 2
    return ids[:half] + ids[-half:]
