"""LooGLE (arXiv 2311.04939): long documents (>24k words) with short- and long-dependency questions, a cloze task and
summaries, as bigai-nlco/LooGLE @ 6734382 (`Prediction/pred_opensource_models.py`, `config/task2prompt.json`,
`config/task2maxlen.json`) and as kvpress @ 8bb29b9 (`evaluation/benchmarks/loogle/`) run them.

Data: `<root>/<task>.jsonl` with the source's fields (`input` the document, `title`, `qa_pairs` a Python literal list
of {"Q", "A", "S"} or "none", `output` the summary), written by `scripts/download_long_context.py loogle`. Each QA
pair is a sample (`<task>-<document index>-<pair index>`); a summarization document is one. Cloze answers are dicts
{"<mask-0>": entity, ...}, kept as JSON text in `answers`.

Protocols (`protocol=`):
- `loogle` (default): `task2prompt.json` byte for byte (its "Organiocation", the spaces before "Summarization:" and
  "Question:" of two templates, `{{...}}` rendered as one brace by `str.format`); over `model.max_prompt_tokens`
  tokens (default special tokens counted), the first and last int(max / 2) tokens, each half decoded without special
  tokens, joined; then tokenized again with default special tokens. New tokens: `task2maxlen.json`. Upstream decodes
  greedily with `repetition_penalty=2.0`, which kvbench's engine does not offer: decoding is plain greedy (or as
  `generation` says). With `model.chat_template` on, the prompt is the user turn (upstream uses none).
- `kvpress`: `create_huggingface_dataset.py`'s context / question / answer-prefix templates (the same words, split
  at the question; the answer prefix opens the assistant turn under a chat template) and kvpress's layout
  (kvbench.data.kvpress_layout); same new tokens; cloze scored with kvpress's exact-match count.
The context (what `query=agnostic` compresses first) is the instruction and the document.
Scores (kvbench.metrics.loogle): per sample `bleu1`, `bleu4`, `rouge1`, `rouge2`, `rougeL` (recall) for QA and
summaries, `exact_match` / `partial_match` (fractions of the sample's masks) for cloze; the primary `loogle` is
ROUGE-L recall, or exact match for cloze. `summarize` writes per task the means (get_semantic_matching) or
sum(matches) / sum(masks) rounded to 4 (get_match_score).
"""
from __future__ import annotations

import ast
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from kvbench.data.base import Dataset, Sample
from kvbench.data.jsonl import find_file, read_jsonl, read_provenance
from kvbench.data.kvpress_layout import kvpress_layout
from kvbench.data.split import content_offset, context_token_count
from kvbench.metrics import loogle as metrics
from kvbench.registry import DATASETS, unknown_choice

logger = logging.getLogger(__name__)

DOWNLOAD_HINT = "run `python scripts/download_long_context.py loogle` (needs the Hugging Face Hub) or set dataset.root"
_QA = "Please answer the question based on the long texts below. \n{input}\nQuestion: {Q}\nAnswer: "
_CLOZE_RULES = ("Please fill in the clozes based on the given long texts below. Each of the placeholder '<mask-n>' in "
                "the question could be an entity of Person, Location or Organiocation. The same masks represent the "
                "same entity. Output a json format answer, for example: {{'<mask-0>': 'Bob', '<mask-1>': 'Gorrosion "
                "Magazine','<mask-2>': 'Bethel Horizon'}}\n{input}")
TASK2PROMPT = {
    "shortdep_qa": _QA,
    "longdep_qa": _QA,
    "longdep_summarization": "Please generate a summary of the below paper. \n{input}\n Summarization: ",
    "shortdep_cloze": _CLOZE_RULES + "\n Question: {Q} What are the masked entities? \nAnswer:",
}
TASK2MAXLEN = {"shortdep_qa": 300, "longdep_qa": 500, "longdep_summarization": 500, "shortdep_cloze": 50}
# kvpress: context template, question template, answer prefix
KVPRESS = {
    "shortdep_qa": ("Please answer the question based on the long texts below. \n{input}", "\nQuestion: {Q}\n",
                    "Answer: "),
    "longdep_qa": ("Please answer the question based on the long texts below. \n{input}", "\nQuestion: {Q}\n",
                   "Answer: "),
    "shortdep_cloze": (_CLOZE_RULES, "\n Question: {Q} What are the masked entities?\n", "Answer:"),
    "longdep_summarization": ("Please generate a summary of the below paper. \n{input}", "{Q}\n", "Summarization: "),
}
# where the question begins in the reference templates (the document ends before it)
QUESTION_MARK = {"shortdep_qa": "\nQuestion: ", "longdep_qa": "\nQuestion: ", "shortdep_cloze": "\n Question: ",
                 "longdep_summarization": "\n Summarization: "}
REQUIRED = {"input": str, "qa_pairs": (str, list)}


@DATASETS.register("loogle")
@dataclass
class LooGLE(Dataset):
    """LooGLE tasks from a local folder. See the module docstring."""

    name: str = "loogle"
    version: str = "1"
    root: str = "data/loogle"
    tasks: list[str] = field(default_factory=lambda: list(KVPRESS))  # kvpress's order
    protocol: Literal["loogle", "kvpress"] = "loogle"
    limit_per_task: int | None = None          # first N samples (questions) of each task
    max_new_tokens: int | None = None          # cap on every task's own (smoke runs); null: task2maxlen.json's
    primary_metric: str = "loogle"
    provenance: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.tasks = [str(t) for t in self.tasks]
        if not self.tasks:
            raise ValueError(f"loogle: tasks is empty; name some of {', '.join(TASK2PROMPT)}")
        for task in self.tasks:
            if task not in TASK2PROMPT:
                raise ValueError("loogle: " + unknown_choice("task", task, list(TASK2PROMPT)))
        if self.protocol not in ("loogle", "kvpress"):
            raise ValueError("loogle: " + unknown_choice("protocol", self.protocol, ["loogle", "kvpress"]))

    def check(self) -> None:
        root = Path(self.root).expanduser()
        missing = [f"{t}.jsonl" for t in self.tasks if find_file(root, t) is None]
        if missing:
            raise FileNotFoundError(f"loogle: {root}/ lacks {', '.join(missing)}; {DOWNLOAD_HINT}.")

    def questions(self, task: str) -> list[tuple[str, dict, str, str]]:
        """(id, record, question, answer text) per sample, in file order."""
        path = find_file(self.root, task)
        out = []
        for d, r in enumerate(read_jsonl(path, REQUIRED, self.name, line_key="_line")):
            if task == "longdep_summarization" or r["qa_pairs"] == "none":
                out.append((f"{task}-{d}", r, "", str(r.get("output", ""))))
                continue
            pairs = r["qa_pairs"] if isinstance(r["qa_pairs"], list) else ast.literal_eval(r["qa_pairs"])
            for q, pair in enumerate(pairs):
                answer = pair["A"]
                out.append((f"{task}-{d}-{q}", r, pair["Q"],
                            json.dumps(answer, ensure_ascii=False) if isinstance(answer, dict) else str(answer)))
        return out[: self.limit_per_task] if self.limit_per_task else out

    def encode(self, tokenizer, task: str, record: dict, question: str, limit: int | None, chat_template: bool):
        """(text, ids, context tokens, context characters, truncated)."""
        if self.protocol == "kvpress":
            context, query, prefix = KVPRESS[task]
            out = kvpress_layout(tokenizer, context.format(input=record["input"]), query.format(Q=question), prefix,
                                 chat_template, limit)
            return out.text, out.ids, out.context_tokens, out.context_chars, out.truncated
        prompt = TASK2PROMPT[task].format(input=record["input"], Q=question)
        ids = tokenizer(prompt).input_ids
        truncated = limit is not None and len(ids) > limit
        if truncated:
            half = int(limit / 2)
            prompt = (tokenizer.decode(ids[:half], skip_special_tokens=True)
                      + tokenizer.decode(ids[-half:], skip_special_tokens=True))
        text, kwargs = prompt, {}
        if chat_template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                 add_generation_prompt=True)
            kwargs = {"add_special_tokens": False}
        ids = tokenizer(text, **kwargs).input_ids
        at = prompt.rfind(QUESTION_MARK[task])
        if at < 0:
            return text, tuple(ids), None, None, truncated
        at += content_offset(text, prompt)
        return text, tuple(ids), context_token_count(tokenizer, text, at, ids, **kwargs), at, truncated

    def build(self, tokenizer, max_prompt_tokens: int | None = None, chat_template: bool = False) -> list[Sample]:
        self.check()
        self.provenance = read_provenance(self.root, self.name)
        samples = []
        for task in self.tasks:
            new_tokens = min(TASK2MAXLEN[task], self.max_new_tokens or TASK2MAXLEN[task])
            for index, (sample_id, record, question, answer) in enumerate(self.questions(task)):
                text, ids, n_context, at, cut = self.encode(tokenizer, task, record, question, max_prompt_tokens,
                                                            chat_template)
                samples.append(Sample(id=sample_id, prompt=text, answers=[answer], max_new_tokens=new_tokens,
                                      meta={"task": task, "index": index, "truncated": cut,
                                            "title": record.get("title")},
                                      input_ids=ids, context_tokens=n_context, context_end=at))
        logger.info("loogle: %d samples from %d tasks (protocol %s)", len(samples), len(self.tasks), self.protocol)
        return samples

    def score(self, sample: Sample, prediction: str) -> dict[str, float]:
        if sample.meta["task"] == "shortdep_cloze":
            exact, n_exact, partial, n_partial = metrics.cloze_matches(json.loads(sample.answers[0]), prediction,
                                                                       kvpress=self.protocol == "kvpress")
            scores = {"exact_match": exact / n_exact if n_exact else 0.0,
                      "partial_match": partial / n_partial if n_partial else 0.0,
                      "exact_count": float(exact), "exact_masks": float(n_exact), "partial_count": float(partial),
                      "partial_masks": float(n_partial)}
            return {"loogle": scores["exact_match"], **scores}
        scores = metrics.generation_scores(sample.answers[0], prediction)
        return {"loogle": scores["rougeL"], **scores}

    def summarize(self, records: list[dict]) -> dict:
        tasks: dict[str, dict] = {}
        for task in self.tasks:
            recs = [r["scores"] for r in records if r["meta"]["task"] == task and "loogle" in r.get("scores", {})]
            if not recs:
                continue
            if task == "shortdep_cloze":
                tasks[task] = {f"{k}_match": round(sum(s[f"{k}_count"] for s in recs)
                                                   / max(sum(s[f"{k}_masks"] for s in recs), 1), 4)
                               for k in ("exact", "partial")}
            else:
                tasks[task] = {k: sum(s[k] for s in recs) / len(recs)
                               for k in ("bleu1", "bleu4", "rouge1", "rouge2", "rougeL")}
        return {"loogle": {"protocol": self.protocol, "tasks": tasks}} if tasks else {}
