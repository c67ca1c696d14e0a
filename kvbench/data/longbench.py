"""LongBench v1 and LongBench-E (THUDM/LongBench `LongBench/pred.py` + `eval.py`, commit 2e00731), read from a local
copy of the official data.zip (`{name}.jsonl`, `{name}_e.jsonl`; get it with scripts/download_longbench.py, whose
`provenance.json`, the Hub revision and the commit read, goes into the manifest).

What happens to each record, in pred.py's order:
1. `prompt = DATASET2PROMPT[task].format(**record)` (kvbench.data.longbench_prompts, byte-exact).
2. Tokenize with the tokenizer's default special tokens (a BOS counts). If longer than the model's
   `max_prompt_tokens`, keep the first and last int(max/2) tokens, decode each half with special tokens skipped and
   join the two texts (middle truncation, before any chat template).
3. Chat template, when the model config's `chat_template` is on, except for the protocol's skip list: the
   tokenizer's template (user turn + generation prompt, then no extra special tokens), or `chat_format`, a
   "{prompt}" string such as LongBench's llama2 "[INST]{prompt}[/INST]" (then tokenized with default special
   tokens, as pred.py). The final token ids go into `Sample.input_ids`; they may exceed the limit by a few tokens.
4. Greedy decoding for `DATASET2MAXLEN[task]` new tokens; samsum also stops at a newline (protocol `longbench`).
5. Scoring (eval.py): trec/triviaqa/samsum/lsht keep the first line of the prediction after leading newlines; the
   sample's score is the max over its answers of the task's metric (kvbench.metrics.longbench); a task's score is
   round(100 * mean, 2). LongBench-E buckets the same scores by the record's `length` field.

Protocols (`protocol=`), the knobs where KV-cache papers left LongBench's pred.py:
- `longbench`: pred.py. Chat template skipped for trec, triviaqa, samsum, lsht, lcc, repobench-p; samsum stops at
  "\\n". Also KVCache-Factory HEAD (2026) and TailorKV. With `chat_template: false` this is also SnapKV's and
  Ada-KV's Mistral/LWM setting (no wrap anywhere).
- `pyramidkv_paper`: PyramidKV's 2024 code (KVCache-Factory @ffac160 `run_longbench.py`): no skip list (if the
  model wraps, all tasks are wrapped) and no newline stop for samsum (EOS only, since 2024-07-05);
  `min_length = prompt + 1` for every task (EOS forbidden as the first token).
samsum under `longbench` stops at the *token* `encode("\\n")[-1]` and forbids it and EOS as the first token
(`min_length`), exactly as pred.py (`Sample.stop_token_ids`, `Sample.min_new_tokens`).
"""
from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvbench.data.base import Dataset, Sample
from kvbench.data.jsonl import read_jsonl, read_provenance
from kvbench.data.split import content_offset, context_token_count, suffix_offset
from kvbench.data.longbench_prompts import (
    CATEGORIES, CHAT_SKIP, DATASET2MAXLEN, DATASET2PROMPT, E_BUCKETS, FIRST_LINE_TASKS, KV16, QUESTION_TEMPLATES, TASKS,
    base_task, length_bucket,
)
from kvbench.metrics.longbench import CODE_SIM_BACKENDS, PAIR_SCORERS, best_over_references
from kvbench.metrics.stats import combine_se, mean_se
from kvbench.registry import DATASETS, unknown_choice

logger = logging.getLogger(__name__)

DOWNLOAD_HINT = "run `python scripts/download_longbench.py` (needs the Hugging Face Hub) or set dataset.root"
REQUIRED_FIELDS = {"input": str, "context": str, "answers": list, "length": int, "_id": str}
CHECKED_FILES: set[tuple[str, int, int]] = set()  # (path, mtime, size) of task files `check()` found well-formed


def newline_token(tokenizer) -> tuple[int]:
    """pred.py's extra eos id for samsum: `tokenizer.encode("\n", add_special_tokens=False)[-1]`."""
    return (tokenizer.encode("\n", add_special_tokens=False)[-1],)


@dataclass(frozen=True)
class Protocol:
    chat_skip: tuple[str, ...]       # tasks never wrapped in a chat template
    newline_stop: tuple[str, ...]    # tasks whose generation stops at the "\n" token (pred.py's extra eos id)
    min_one_token: tuple[str, ...] | None  # tasks with min_length = prompt + 1 (None: every task)


PROTOCOLS = {
    "longbench": Protocol(chat_skip=CHAT_SKIP, newline_stop=("samsum",), min_one_token=("samsum",)),
    "pyramidkv_paper": Protocol(chat_skip=(), newline_stop=(), min_one_token=None),
}


def read_records(path: Path) -> list[dict]:
    """The records of one jsonl file; a bad line raises a one-line error naming the file and line."""
    records = read_jsonl(path, REQUIRED_FIELDS, "longbench", line_key="_line")
    for record in records:
        where = f"longbench: {path}:{record['_line']}"
        if not all(isinstance(a, str) for a in record["answers"]) or not record["answers"]:
            raise ValueError(f"{where}: 'answers' must be a non-empty list of strings")
        classes = record.get("all_classes")
        if classes is not None and not (isinstance(classes, list) and all(isinstance(c, str) for c in classes)):
            raise ValueError(f"{where}: 'all_classes' must be null or a list of strings")
    return records


def middle_truncate(tokenizer, prompt: str, max_length: int | None) -> tuple[str, bool]:
    """pred.py: if the prompt has more than `max_length` tokens (default special tokens counted), keep the first
    and last int(max_length / 2) tokens, each half decoded with special tokens skipped, joined with nothing."""
    ids = tokenizer(prompt, truncation=False).input_ids
    if max_length is None or len(ids) <= max_length:
        return prompt, False
    half = int(max_length / 2)
    return (tokenizer.decode(ids[:half], skip_special_tokens=True)
            + tokenizer.decode(ids[-half:], skip_special_tokens=True)), True


@DATASETS.register("longbench")
@dataclass
class LongBench(Dataset):
    """LongBench v1 / LongBench-E tasks from a local folder; sample ids `{file stem}-{_id}`.

    `tasks` are data.zip file stems: a task name (`qasper`) or its LongBench-E file (`qasper_e`). The default is
    the 16 English + code tasks of the KV-cache papers in their column order; configs/dataset/longbench_all.yaml
    and longbench_e.yaml hold the 21 tasks and LongBench-E. The per-sample score (`longbench`) is the task's own
    metric in [0, 1]; `summarize` adds per-task scores x 100, the papers' Avg., LongBench's category means and
    the LongBench-E buckets to scores.json.
    """

    name: str = "longbench"
    version: str = "1"
    root: str = "data/longbench"                       # folder with {task}.jsonl (data.zip unpacked)
    tasks: list[str] = field(default_factory=lambda: list(KV16))
    limit_per_task: int | None = None                  # first N records of each task file
    protocol: str = "longbench"                        # see PROTOCOLS and the module docstring
    chat_format: str | None = None                     # "{prompt}" wrapper instead of the tokenizer's chat template
    code_sim_backend: str = "difflib"                  # fuzz.ratio backend: difflib (LongBench's env) | levenshtein
    primary_metric: str = "longbench"
    max_new_tokens: int | None = None                  # cap on every task's own budget (smoke runs); null = pred.py's
    provenance: dict = field(default_factory=dict, init=False, repr=False)  # provenance.json, into the manifest

    def __post_init__(self) -> None:
        self.tasks = [str(t) for t in self.tasks]      # Hydra hands over a ListConfig
        if not self.tasks:
            raise ValueError("longbench: tasks is empty; name data.zip file stems such as qasper or qasper_e.")
        for stem in self.tasks:
            if base_task(stem) not in TASKS:
                raise ValueError("longbench: " + unknown_choice("task", stem, [*TASKS, *(f"{t}_e" for t in TASKS)]))
        duplicates = sorted({t for t in self.tasks if self.tasks.count(t) > 1})
        if duplicates:
            raise ValueError(f"longbench: tasks lists {duplicates} more than once.")
        if self.protocol not in PROTOCOLS:
            raise ValueError("longbench: " + unknown_choice("protocol", self.protocol, list(PROTOCOLS)))
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"longbench: max_new_tokens={self.max_new_tokens} must be >= 1 (or null: each task's own)")
        if self.limit_per_task is not None and self.limit_per_task < 1:
            raise ValueError(f"longbench: limit_per_task={self.limit_per_task} must be >= 1 or null.")
        if self.chat_format is not None and "{prompt}" not in self.chat_format:
            raise ValueError(f"longbench: chat_format={self.chat_format!r} must contain {{prompt}}.")
        if self.code_sim_backend not in CODE_SIM_BACKENDS:
            raise ValueError(f"longbench: code_sim_backend={self.code_sim_backend!r}; "
                             f"use one of {', '.join(CODE_SIM_BACKENDS)}.")

    # --- reading ----------------------------------------------------------------------------------------------

    def task_path(self, stem: str) -> Path:
        return Path(self.root).expanduser() / f"{stem}.jsonl"

    def check(self) -> None:
        """Raise a one-line error if the folder or a task file is missing or a record is malformed (before weights
        load); a well-formed file is parsed once per process."""
        root = Path(self.root).expanduser()
        if not root.is_dir():
            raise FileNotFoundError(f"longbench: no folder {root}/; {DOWNLOAD_HINT}=<folder with the jsonl files>.")
        missing = [f"{t}.jsonl" for t in self.tasks if not self.task_path(t).is_file()]
        if missing:
            raise FileNotFoundError(f"longbench: {root}/ lacks {', '.join(missing)}; {DOWNLOAD_HINT}.")
        for stem in self.tasks:  # a malformed line or a repeated _id: one line now, not after the weights load
            path = self.task_path(stem)
            stat = path.stat()
            if (str(path), stat.st_mtime_ns, stat.st_size) not in CHECKED_FILES:
                self.read_task(stem)
                CHECKED_FILES.add((str(path), stat.st_mtime_ns, stat.st_size))

    def read_task(self, stem: str) -> list[dict]:
        records = read_records(self.task_path(stem))
        seen: dict[str, int] = {}
        for r in records:
            if r["_id"] in seen:
                raise ValueError(f"longbench: {self.task_path(stem)}:{r['_line']}: _id {r['_id']!r} repeats line "
                                 f"{seen[r['_id']]}; sample ids must be unique.")
            seen[r["_id"]] = r["_line"]
        return records[: self.limit_per_task] if self.limit_per_task else records

    # --- building ---------------------------------------------------------------------------------------------

    def wraps(self, stem: str, chat_template: bool) -> bool:
        return chat_template and base_task(stem) not in PROTOCOLS[self.protocol].chat_skip

    def encode(self, tokenizer, prompt: str, wrap: bool) -> tuple[str, list[int]]:
        """The final text and token ids after the chat-template rule (step 3 of the module docstring)."""
        if not wrap:
            return prompt, tokenizer(prompt, truncation=False).input_ids
        if self.chat_format is not None:
            text = self.chat_format.replace("{prompt}", prompt)
            return text, tokenizer(text, truncation=False).input_ids
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return text, tokenizer(text, add_special_tokens=False, truncation=False).input_ids

    def split(self, tokenizer, task: str, record: dict, prompt: str, text: str, ids: list[int],
              wrap: bool) -> tuple[int | None, int | None]:
        """Where the context ends in `text` (characters) and `ids` (tokens): the task's template split at its own
        boundary (`QUESTION_TEMPLATES`), inside the chat turn when wrapped. (None, None) if a middle cut reached the
        question (then both modes run the same prompt)."""
        at = suffix_offset(prompt, QUESTION_TEMPLATES[task].format(**record))
        if at is None:
            return None, None
        at += content_offset(text, prompt)
        kwargs = {"add_special_tokens": False} if wrap and self.chat_format is None else {}
        return at, context_token_count(tokenizer, text, at, ids, truncation=False, **kwargs)

    def build(self, tokenizer, max_prompt_tokens: int | None = None, chat_template: bool = False) -> list[Sample]:
        """Samples task by task, in `tasks` order and file order within a task."""
        self.check()
        self.provenance = read_provenance(self.root, self.name)
        protocol = PROTOCOLS[self.protocol]
        samples: list[Sample] = []
        n_truncated = 0
        for stem in self.tasks:
            task = base_task(stem)
            wrap = self.wraps(stem, chat_template)
            for index, record in enumerate(self.read_task(stem)):
                prompt, truncated = middle_truncate(tokenizer, DATASET2PROMPT[task].format(**record),
                                                    max_prompt_tokens)
                text, ids = self.encode(tokenizer, prompt, wrap)
                context_end, context_tokens = self.split(tokenizer, task, record, prompt, text, ids, wrap)
                n_truncated += truncated
                meta = {"task": stem, "index": index, "length": record["length"], "truncated": truncated,
                        "chat": wrap}
                if record.get("all_classes") is not None:
                    meta["all_classes"] = record["all_classes"]
                min_one = protocol.min_one_token is None or task in protocol.min_one_token
                samples.append(Sample(
                    id=f"{stem}-{record['_id']}", prompt=text, answers=list(record["answers"]),
                    max_new_tokens=min(DATASET2MAXLEN[task], self.max_new_tokens or DATASET2MAXLEN[task]),
                    meta=meta, input_ids=tuple(ids), context_end=context_end, context_tokens=context_tokens,
                    stop_token_ids=newline_token(tokenizer) if task in protocol.newline_stop else (),
                    min_new_tokens=1 if min_one else 0,
                ))
        logger.info("longbench: %d samples from %d tasks in %s (protocol %s, chat template %s, %d middle-truncated "
                    "to %s tokens)", len(samples), len(self.tasks), self.root, self.protocol,
                    "on" if chat_template else "off", n_truncated, max_prompt_tokens)
        return samples

    # --- scoring ----------------------------------------------------------------------------------------------

    def score(self, sample: Sample, prediction: str) -> dict[str, float]:
        """eval.py for one sample: the first-line rule where it applies, then the max over the answers."""
        task = base_task(sample.meta["task"])
        if task in FIRST_LINE_TASKS:
            prediction = prediction.lstrip("\n").split("\n")[0]
        metric = TASKS[task].metric
        extra = {"backend": self.code_sim_backend} if metric == "code_sim" else {}
        value = best_over_references(PAIR_SCORERS[metric], prediction, sample.answers,
                                     all_classes=sample.meta.get("all_classes"), **extra)
        return {"longbench": float(value)}

    def summarize(self, records: list[dict]) -> dict:
        """{"longbench": ...} for scores.json: see `summarize_longbench`, plus the protocol that produced them."""
        protocol = PROTOCOLS[self.protocol]
        return {"longbench": {
            "protocol": self.protocol, "chat_skip": list(protocol.chat_skip),
            "newline_stop": list(protocol.newline_stop), "chat_format": self.chat_format,
            "code_sim_backend": self.code_sim_backend,
            **summarize_longbench(records, order=self.tasks),
        }}


def task_scores(records: list[dict]) -> dict[str, list[dict]]:
    """Records grouped by task file stem, each group in file order."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        groups[r["meta"]["task"]].append(r)
    return {t: sorted(g, key=lambda r: r["meta"].get("index", 0)) for t, g in groups.items()}


def eval_score(scores: list[float]) -> float:
    """eval.py `scorer`: round(100 * running sum / n, 2)."""
    total = 0.0
    for s in scores:
        total += s
    return round(100 * total / len(scores), 2)


def bucket_scores(scores: list[float], lengths: list[int]) -> dict[str, float | None]:
    """eval.py `scorer_e`: round(100 * np.mean(bucket), 2); an empty bucket is None (upstream writes NaN)."""
    buckets: dict[str, list[float]] = {b: [] for b in E_BUCKETS}
    for s, length in zip(scores, lengths):
        buckets[length_bucket(length)].append(s)
    return {b: round(100 * float(np.mean(v)), 2) if v else None for b, v in buckets.items()}


def bucket_se(scores: list[float], lengths: list[int]) -> dict[str, float | None]:
    """The standard error (x100, sd / sqrt(n)) beside each of `bucket_scores`' buckets; None for fewer than 2."""
    buckets: dict[str, list[float]] = {b: [] for b in E_BUCKETS}
    for s, length in zip(scores, lengths):
        buckets[length_bucket(length)].append(s)
    out: dict[str, float | None] = {}
    for b, values in buckets.items():
        se = mean_se(values).scaled(100).se
        out[b] = None if se is None else round(se, 4)
    return out


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return round(sum(values) / len(values), 2) if values else None


def summarize_longbench(records: list[dict], order: list[str] | None = None) -> dict:
    """Aggregates of finished records (each with `score` and `meta.task`, `meta.length`):

    - `tasks`: per task file, round(100 * mean, 2) as eval.py; `n`: samples per task;
    - `avg`: the KV papers' "Avg.", the plain mean of the task scores present;
    - `categories`: LongBench's leaderboard, per language ("en", "zh"; code counts for both): the mean of each
      category's tasks and `Avg` = the mean of the categories present;
    - `tasks_se`, `avg_se`, `categories_se` (and `e_buckets_se`, `e_avg_se`): standard errors on the same x100
      scale (`longbench_se`, `bucket_se`);
    - `e_buckets` / `e_avg` (LongBench-E files only): per task the 0-4k / 4-8k / 8k+ scores of `scorer_e`, and
      their mean over tasks per bucket (the README's curve).
    """
    groups = task_scores(records)
    stems = [t for t in (order or []) if t in groups] + sorted(t for t in groups if t not in (order or []))
    tasks = {t: eval_score([r["score"] for r in groups[t]]) for t in stems}
    out: dict = {"tasks": tasks, "n": {t: len(groups[t]) for t in stems}, "avg": _mean(list(tasks.values()))}
    categories: dict[str, dict] = {}
    for lang in ("en", "zh"):
        per_cat = {c: _mean([s for t, s in tasks.items() if TASKS[base_task(t)].category == c
                             and TASKS[base_task(t)].lang in (lang, "code")]) for c in CATEGORIES}
        if any(TASKS[base_task(t)].lang in ((lang, "code") if lang == "en" else (lang,)) for t in tasks):
            per_cat = {c: v for c, v in per_cat.items() if v is not None}
            categories[lang] = {**per_cat, "Avg": _mean(list(per_cat.values()))}
    out["categories"] = categories
    out.update(longbench_se(groups, tasks, categories))
    e_stems = [t for t in stems if t != base_task(t)]
    if e_stems:
        out["e_buckets"] = {t: bucket_scores([r["score"] for r in groups[t]], [r["meta"]["length"] for r in groups[t]])
                            for t in e_stems}
        out["e_avg"] = {b: _mean([out["e_buckets"][t][b] for t in e_stems]) for b in E_BUCKETS}
        out["e_buckets_se"] = {t: bucket_se([r["score"] for r in groups[t]], [r["meta"]["length"] for r in groups[t]])
                               for t in e_stems}
        out["e_avg_se"] = {b: _se([out["e_buckets_se"][t][b] for t in e_stems if out["e_buckets"][t][b] is not None])
                           for b in E_BUCKETS}
    return out


def _se(ses: list[float | None]) -> float | None:
    """se of the plain mean of independent means (kvbench.metrics.stats.combine_se), rounded like the scores' se."""
    se = combine_se(ses, [1 / len(ses)] * len(ses)) if ses else None
    return None if se is None else round(se, 4)


def longbench_se(groups: dict[str, list[dict]], tasks: dict[str, float], categories: dict[str, dict]) -> dict:
    """Standard errors beside `tasks`, `avg` and `categories`, x100 like them: per task sd / sqrt(n) of its samples'
    scores; an average of task means gets sqrt(sum_t se_t^2) / T, the se of that mean of samples
    (kvbench.metrics.stats)."""
    se = {t: mean_se(r["score"] for r in groups[t]).scaled(100).se for t in tasks}
    cats_se = {}
    for lang, block in categories.items():
        members = {c: [t for t in tasks if TASKS[base_task(t)].category == c and TASKS[base_task(t)].lang in
                       (lang, "code")] for c in block if c != "Avg"}
        cats_se[lang] = {c: _se([se[t] for t in ts]) for c, ts in members.items()}
        # Avg = mean over categories of category means: task t weighs 1 / (n_categories * n_tasks_in_its_category)
        weights = [(se[t], 1 / (len(members) * len(ts))) for ts in members.values() for t in ts]
        avg = combine_se([s for s, _ in weights], [w for _, w in weights]) if weights else None
        cats_se[lang]["Avg"] = None if avg is None else round(avg, 4)
    return {"tasks_se": {t: None if v is None else round(v, 4) for t, v in se.items()},
            "avg_se": _se(list(se.values())), "categories_se": cats_se}
