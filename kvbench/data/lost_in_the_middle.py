"""10-document QA from "Lost in the Middle" (NQ-open, 10 total documents, gold at positions 0, 4, 9), as BUZZ ran it.

Data: the files nelson-liu/lost-in-the-middle ships under `qa_data/10_total_documents/`,
`nq-open-10_total_documents_gold_at_{k}.jsonl(.gz)` with fields `question`, `answers`, `ctxs` (each `title`, `text`,
`isgold`), in a local folder (`dataset.root`; `scripts/download_seed_tasks.py` fetches them at a pinned commit, the
10-document files having been re-uploaded in 2024-01, and records it in `provenance.json`, then the manifest).

Prompt: BUZZ's `run_ten_doc_qa_em.py` (JunqiZhao888/buzz-llm @ e6f5e3e), byte for byte, its typos included
("Documents are following:", "give an brief answer", the ". " after the documents' trailing newline): every
document contributes `title + "\\n" + text + "\\n"`. Plain text, no chat template; greedy; BUZZ generated up to
1000 tokens, here `max_new_tokens` (default 100, kvbench's cap: the answer is on the first line). The first
`num_samples` questions of each gold position (BUZZ: 40, only gold_at_4 wired up in its code).

Scoring: lost-in-the-middle's evaluation, `best_subspan_em` of the first line of the prediction against all
`answers` (primary), and BUZZ's strict `exact_match` against `answers[0]`. The report shows one column per gold
position and their average (BUZZ Fig. 6).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvbench.data.base import Dataset, Sample
from kvbench.data.jsonl import find_file, read_jsonl, read_provenance
from kvbench.data.split import context_token_count, cut_context, split_template, suffix_offset
from kvbench.metrics.qa import best_subspan_em, exact_match, first_line
from kvbench.registry import DATASETS

logger = logging.getLogger(__name__)

BUZZ_QA_TEMPLATE = ("Documents are following: {documents}. Based on the provided documents, give an brief answer "
                    "to this question: {question}. The answer has to directly answer the question and be BRIEF. ")
# query=agnostic: the question part starts at "Based on the provided documents" (after the documents and ". ")
QUESTION_TEMPLATE = split_template(BUZZ_QA_TEMPLATE, "documents", boundary="Based on the provided documents")[1]
FILE_STEM = "nq-open-10_total_documents_gold_at_{position}"
DOWNLOAD_HINT = ("run `python scripts/download_seed_tasks.py lost_in_the_middle` (needs github.com) "
                 "or set dataset.root")


def buzz_qa_prompt(question: str, ctxs: list[dict]) -> str:
    """`transform_to_prompt` for one record."""
    documents = "".join(ctx["title"] + "\n" + ctx["text"] + "\n" for ctx in ctxs)
    return BUZZ_QA_TEMPLATE.format(documents=documents, question=question)


@DATASETS.register("lost_in_the_middle")
@dataclass
class LostInTheMiddle(Dataset):
    """NQ-open 10-document QA at several gold positions; sample ids `gold{k}-{line index}`."""

    name: str = "lost_in_the_middle"
    version: str = "1"
    root: str = "data/lost_in_the_middle"
    gold_positions: list[int] = field(default_factory=lambda: [0, 4, 9])
    num_samples: int | None = 40      # first N questions per gold position (BUZZ: 40); null = all
    max_new_tokens: int = 100
    primary_metric: str = "best_subspan_em"
    provenance: dict = field(default_factory=dict, init=False, repr=False)  # provenance.json, into the manifest

    def __post_init__(self) -> None:
        self.gold_positions = [int(p) for p in self.gold_positions]
        bad = [p for p in self.gold_positions if not 0 <= p <= 9]
        if bad or not self.gold_positions:
            raise ValueError(f"lost_in_the_middle: gold_positions={self.gold_positions} must be a non-empty list "
                             "of positions in 0..9 (the source ships 0, 4, 9).")
        if self.num_samples is not None and self.num_samples < 1:
            raise ValueError(f"lost_in_the_middle: num_samples={self.num_samples} must be >= 1 or null.")

    def check(self) -> None:
        root = Path(self.root).expanduser()
        missing = [FILE_STEM.format(position=p) + ".jsonl" for p in self.gold_positions
                   if find_file(root, FILE_STEM.format(position=p)) is None]
        if missing:
            raise FileNotFoundError(f"lost_in_the_middle: {root}/ lacks {', '.join(missing)}; {DOWNLOAD_HINT}.")

    def build(self, tokenizer, max_prompt_tokens: int | None = None, chat_template: bool = False) -> list[Sample]:
        self.check()
        self.provenance = read_provenance(self.root, self.name)
        samples = []
        for position in self.gold_positions:
            path = find_file(self.root, FILE_STEM.format(position=position))
            records = read_jsonl(path, {"question": str, "answers": list, "ctxs": list}, self.name)
            for index, record in enumerate(records[: self.num_samples]):
                if not record["answers"] or not all(isinstance(a, str) for a in record["answers"]):
                    raise ValueError(f"lost_in_the_middle: {path}: record {index}: 'answers' must be a non-empty "
                                     "list of strings")
                gold = [i for i, c in enumerate(record["ctxs"]) if c.get("isgold")]
                prompt = buzz_qa_prompt(record["question"], record["ctxs"])
                ids = tokenizer(prompt).input_ids
                context_end = suffix_offset(prompt, QUESTION_TEMPLATE.format(question=record["question"]))
                n_context, n_full = context_token_count(tokenizer, prompt, context_end, ids), len(ids)
                if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
                    half = max_prompt_tokens // 2
                    ids = ids[:half] + ids[-half:]
                    n_context = cut_context(n_context, n_full, len(ids), half)
                samples.append(Sample(
                    id=f"gold{position}-{index}", prompt=prompt, answers=list(record["answers"]),
                    max_new_tokens=self.max_new_tokens, input_ids=tuple(ids), context_end=context_end,
                    context_tokens=n_context,
                    meta={"task": f"gold_at_{position}", "gold_position": position, "index": index,
                          "gold_in_ctxs": gold[0] if gold else None}))
        logger.info("lost_in_the_middle: %d samples at gold positions %s", len(samples), self.gold_positions)
        return samples

    def score(self, sample: Sample, prediction: str) -> dict[str, float]:
        return {"best_subspan_em": best_subspan_em(first_line(prediction), sample.answers),
                "exact_match": exact_match(prediction, sample.answers)}

    def summarize(self, records: list[dict]) -> dict:
        """Per gold position: mean best_subspan_em x 100 (BUZZ Fig. 6), and the average over positions."""
        by_position: dict[int, list[float]] = {}
        for r in records:
            by_position.setdefault(int(r["meta"]["gold_position"]), []).append(r["scores"]["best_subspan_em"])
        table = {f"gold_at_{p}": 100 * float(np.mean(v)) for p, v in sorted(by_position.items())}
        avg = float(np.mean(list(table.values()))) if table else None
        return {"lost_in_the_middle": {"best_subspan_em": table, "avg": avg,
                                       "n": {f"gold_at_{p}": len(v) for p, v in sorted(by_position.items())}}}
