"""ZeroSCROLLS (arXiv 2305.14196): ten long-text tasks whose prompts ship inside the data (`input` = instruction,
document, query, answer header), run as tau-nlp/zero_scrolls @ c994676 and as kvpress @ 8bb29b9 run them.

Data: `<root>/<task>_<split>.jsonl` with the source's fields (`id`, `pid`, `input`, `output`, `document_start_index`,
`document_end_index`, `query_start_index`, `query_end_index`, `truncation_seperator` [sic]), written by
`scripts/download_long_context.py zero_scrolls` (provenance.json into the manifest). Rows sharing an `id` are one
sample whose references are all their outputs (SCROLLS' `drop_duplicates_in_input`). Only `validation` has outputs
(about 20 per task); the test outputs are hidden (the leaderboard scores them), so kvbench scores the validation split.

Protocols (`protocol=`):
- `zero_scrolls` (default): `experiments/hf/run_hf_model.py: process_model_input`: the whole `input`; over
  `model.max_prompt_tokens` tokens, the text before the query is cut at its head to leave room for
  `truncation_seperator + input[query_start_index:]`, tokenized apart and appended (without special tokens: the
  reference's T5 tokenizer adds only a closing </s> there). New tokens per task: `experiments/api/api.py:
  dataset_to_leave_tokens_for_generations` (run_hf_model.py itself allows 1024 for every task). With
  `model.chat_template` on, the input is the user turn (the API runner's chat rewording is not applied).
- `kvpress`: `evaluation/benchmarks/zero_scrolls/create_huggingface_dataset.py`: context = input up to
  `document_end_index`, question = up to `query_end_index`, answer prefix = the rest, stripped; kvpress's layout
  (kvbench.data.kvpress_layout) and the same new-token table.
Either way the context (what `query=agnostic` compresses first) ends at `document_end_index`.
Scores (kvbench.metrics.zero_scrolls): each task's metric per sample in [0, 1] (`zero_scrolls`, the primary; plus
`rouge1`, `rouge2`, `rougeL` for the summaries); `summarize` writes per-task scores x 100 (the summaries: the
geometric mean of the three ROUGE means) and their plain average, the leaderboard's "Avg.".
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

from kvbench.data.base import Dataset, Sample
from kvbench.data.jsonl import find_file, read_jsonl, read_provenance
from kvbench.data.kvpress_layout import kvpress_layout
from kvbench.data.split import content_offset, context_token_count
from kvbench.metrics import zero_scrolls as zs
from kvbench.registry import DATASETS, unknown_choice

logger = logging.getLogger(__name__)

DOWNLOAD_HINT = ("run `python scripts/download_long_context.py zero_scrolls` (needs the Hugging Face Hub) or set "
                 "dataset.root")
# task -> (metric, new tokens): api.py's dataset_to_leave_tokens_for_generations, kvpress's MAX_NEW_TOKENS (equal)
TASKS = {
    "gov_report": ("rouge", 1024), "summ_screen_fd": ("rouge", 512), "qmsum": ("rouge", 512),
    "qasper": ("f1", 128), "narrative_qa": ("f1", 64), "quality": ("accuracy", 10), "musique": ("f1", 32),
    "squality": ("rouge", 512), "space_digest": ("exp_similarity", 36), "book_sum_sort": ("concordance_index", 256),
}
REQUIRED = {"id": str, "input": str, "document_end_index": int, "query_start_index": int, "query_end_index": int,
            "truncation_seperator": str}


def reference_ids(tokenizer, record: dict, limit: int | None) -> tuple[list[int], bool]:
    """run_hf_model.py `process_model_input` (see the module docstring)."""
    text = record["input"]
    ids = tokenizer(text).input_ids
    if limit is None or len(ids) <= limit:
        return ids, False
    tail = tokenizer(record["truncation_seperator"] + text[record["query_start_index"]:],
                     add_special_tokens=False).input_ids
    head = tokenizer(text[:record["query_start_index"]]).input_ids[:max(limit - len(tail), 0)]
    return head + tail, True


@DATASETS.register("zero_scrolls")
@dataclass
class ZeroScrolls(Dataset):
    """ZeroSCROLLS validation tasks from a local folder; sample ids `<task>-<id>`. See the module docstring."""

    name: str = "zero_scrolls"
    version: str = "1"
    root: str = "data/zero_scrolls"
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    protocol: Literal["zero_scrolls", "kvpress"] = "zero_scrolls"
    limit_per_task: int | None = None
    max_new_tokens: int | None = None          # cap on every task's own (smoke runs); null: the table's
    primary_metric: str = "zero_scrolls"
    provenance: dict = field(default_factory=dict, init=False, repr=False)
    split: ClassVar[str] = "validation"  # the only split with answers

    def __post_init__(self) -> None:
        self.tasks = [str(t) for t in self.tasks]
        if not self.tasks:
            raise ValueError(f"zero_scrolls: tasks is empty; name some of {', '.join(TASKS)}")
        for task in self.tasks:
            if task not in TASKS:
                raise ValueError("zero_scrolls: " + unknown_choice("task", task, list(TASKS)))
        if self.protocol not in ("zero_scrolls", "kvpress"):
            raise ValueError("zero_scrolls: " + unknown_choice("protocol", self.protocol, ["zero_scrolls", "kvpress"]))

    def check(self) -> None:
        root = Path(self.root).expanduser()
        missing = [f"{t}_{self.split}.jsonl" for t in self.tasks if find_file(root, f"{t}_{self.split}") is None]
        if missing:
            raise FileNotFoundError(f"zero_scrolls: {root}/ lacks {', '.join(missing)}; {DOWNLOAD_HINT}.")

    def examples(self, task: str) -> list[tuple[dict, list[str]]]:
        """(first row, every output) per id, in file order."""
        path = find_file(self.root, f"{task}_{self.split}")
        grouped: dict[str, tuple[dict, list[str]]] = {}
        for r in read_jsonl(path, REQUIRED, self.name, line_key="_line"):
            if not isinstance(r.get("output"), str):
                raise ValueError(f"zero_scrolls: {path}:{r['_line']}: 'output' must be a string (the test split's "
                                 "outputs are hidden: score the validation split)")
            grouped.setdefault(r["id"], (r, []))[1].append(r["output"])
        examples = list(grouped.values())
        return examples[: self.limit_per_task] if self.limit_per_task else examples

    def encode(self, tokenizer, r: dict, limit: int | None, chat_template: bool):
        """(text, ids, context tokens, context characters, truncated)."""
        doc_end, query_end = r["document_end_index"], r["query_end_index"]
        if self.protocol == "kvpress":
            out = kvpress_layout(tokenizer, r["input"][:doc_end], r["input"][doc_end:query_end],
                                 r["input"][query_end:].strip(), chat_template, limit)
            return out.text, out.ids, out.context_tokens, out.context_chars, out.truncated
        if chat_template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": r["input"]}], tokenize=False,
                                                 add_generation_prompt=True)
            ids, cut = reference_ids(_NoSpecial(tokenizer), {**r, "input": text,
                                                              "query_start_index": content_offset(text, r["input"])
                                                              + r["query_start_index"]}, limit)
            at = content_offset(text, r["input"]) + doc_end
            return text, tuple(ids), None if cut else context_token_count(
                tokenizer, text, at, ids, add_special_tokens=False), None if cut else at, cut
        ids, cut = reference_ids(tokenizer, r, limit)
        if cut:  # the document's end was cut away: no split
            return r["input"], tuple(ids), None, None, True
        return r["input"], tuple(ids), context_token_count(tokenizer, r["input"], doc_end, ids), doc_end, False

    def build(self, tokenizer, max_prompt_tokens: int | None = None, chat_template: bool = False) -> list[Sample]:
        self.check()
        self.provenance = read_provenance(self.root, self.name)
        samples = []
        for task in self.tasks:
            new_tokens = min(TASKS[task][1], self.max_new_tokens or TASKS[task][1])
            for index, (r, outputs) in enumerate(self.examples(task)):
                text, ids, n_context, context_end, cut = self.encode(tokenizer, r, max_prompt_tokens, chat_template)
                samples.append(Sample(id=f"{task}-{r['id']}", prompt=text, answers=outputs, max_new_tokens=new_tokens,
                                      meta={"task": task, "index": index, "truncated": cut, "pid": r.get("pid")},
                                      input_ids=ids, context_tokens=n_context, context_end=context_end))
        logger.info("zero_scrolls: %d samples from %d tasks (protocol %s)", len(samples), len(self.tasks),
                    self.protocol)
        return samples

    def score(self, sample: Sample, prediction: str) -> dict[str, float]:
        metric = TASKS[sample.meta["task"]][0]
        if metric == "rouge":
            per_ref = [zs.rouge(prediction, ref) for ref in sample.answers]
            out = {k: max(s[k] for s in per_ref) for k in ("rouge1", "rouge2", "rougeL")}
            return {"zero_scrolls": zs.geometric_rouge(out), **out}
        return {"zero_scrolls": float(zs.best_over_references(zs.SCORERS[metric], prediction, sample.answers))}

    def summarize(self, records: list[dict]) -> dict:
        """Per task x 100 (summaries: the geometric mean of the ROUGE means) and "Avg." over the tasks present."""
        tasks: dict[str, float] = {}
        for task in self.tasks:
            recs = [r for r in records if r["meta"]["task"] == task and "zero_scrolls" in r.get("scores", {})]
            if not recs:
                continue
            if TASKS[task][0] == "rouge":
                means = {k: sum(r["scores"][k] for r in recs) / len(recs) for k in ("rouge1", "rouge2", "rougeL")}
                tasks[task] = 100 * zs.geometric_rouge(means)
            else:
                tasks[task] = 100 * sum(r["scores"]["zero_scrolls"] for r in recs) / len(recs)
        if not tasks:
            return {}
        return {"zero_scrolls": {"protocol": self.protocol, "tasks": tasks,
                                 "avg": sum(tasks.values()) / len(tasks)}}


class _NoSpecial:
    """A tokenizer whose calls add no special tokens (a chat-rendered prompt already holds them)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, text, **kwargs):
        return self.tokenizer(text, **{**kwargs, "add_special_tokens": False})
