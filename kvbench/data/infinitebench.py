"""InfiniteBench (OpenBMB/InfiniteBench @ 88b3daa): the nine tasks TailorKV reports (Table 15), official prompts.

Data: the Hub dataset `xinrongzhang2022/InfiniteBench`, one `{task}.jsonl` per task with its own fields (`id`,
`context`, `input`, `answer`, `options`), in a local folder (`dataset.root`; `scripts/download_seed_tasks.py`, which
records the Hub revision and the commit read in `provenance.json`, then the manifest: several files were re-uploaded
in 2024, so compare runs by commit).

Per record, as upstream's `create_prompt` with the `yarn_mistral_templates` (used for every open model, and by
TailorKV's `llama.py`/`yi.py`; kvbench.data.infinitebench_prompts, byte for byte): math_find's prefix is built
from the question ("What is {the target number} in the following list?"), the choice tasks list options A-D. The
prompt is tokenized with default special tokens (`tok.encode`), and if longer than `truncate_tokens` the first and
last half are kept (middle truncation). `protocol=tailorkv` feeds those ids as they are (TailorKV: 131072 tokens
for Llama-3.1, 200000 for Yi); `protocol=official` decodes them back to text and re-tokenizes (upstream's
`truncate_by_tokens`). `truncate_tokens: null` uses the model's `max_prompt_tokens`. No chat template; greedy;
max new tokens per task (`DATA_NAME_TO_MAX_NEW_TOKENS`); the prediction is stripped before scoring.

Scores: each task's own scorer (kvbench.metrics.infinitebench), `official` or TailorKV's variant (`scorer`, which
follows `protocol` unless set). The report shows one column per task and "Avg." = the mean of the nine task scores
(TailorKV's Table 15 average).
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

from kvbench.data.base import Dataset, Sample, middle_cut
from kvbench.data.infinitebench_prompts import MAX_NEW_TOKENS, TAILORKV_TASKS, TEMPLATES
from kvbench.data.jsonl import find_file, read_jsonl, read_provenance
from kvbench.data.split import context_token_count, cut_context, question_offset, split_template
from kvbench.metrics.infinitebench import SCORERS, score_one
from kvbench.registry import DATASETS, unknown_choice

logger = logging.getLogger(__name__)

DOWNLOAD_HINT = ("run `python scripts/download_seed_tasks.py infinitebench` (needs the Hugging Face Hub) "
                 "or set dataset.root")
OPTIONS = "ABCD"


def build_prompt(task: str, eg: dict) -> str:
    """Upstream `create_prompt(eg, task, "yarn-mistral")`."""
    template = TEMPLATES[task]
    if task == "code_run":
        func_call = re.findall(r"func_[0-9]+\(\-?[0-9]+\)", eg["input"])[0]
        return template.format(func=func_call.split("(")[0], func_call=func_call, context=eg["context"])
    if task in ("code_debug", "longbook_choice_eng"):
        options = {f"OPTION_{k}": eg["options"][i] for i, k in enumerate(OPTIONS)}
        return template.format(context=eg["context"], question=eg.get("input", ""), **options)
    if task in ("longbook_qa_eng", "longbook_qa_chn"):
        return template.format(question=eg["input"], context=eg["context"])
    if task == "math_find":
        found = re.findall(r"The .+ of", eg["input"])
        if not found:
            raise ValueError(f"infinitebench: math_find record {eg.get('id')}: no 'The ... of' in its input")
        prefix = f"What is {found[0].lower()[:-3]} in the following list?"
        return template.format(prefix=prefix, context=eg["context"], input=eg["input"])
    if task in ("longdialogue_qa_eng", "longbook_sum_eng", "math_calc"):
        return template.format(context=eg["context"])
    return template.format(context=eg["context"], input=eg["input"])


def get_label(task: str, eg: dict):
    """Upstream `get_answer`: [answer, letter] for the option tasks, else the record's `answer`."""
    if task not in ("code_debug", "longbook_choice_eng"):
        return eg["answer"]
    answer = eg["answer"]
    if isinstance(answer, list) and len(answer) == 2 and answer[1] in OPTIONS:
        return answer
    text = answer[0] if isinstance(answer, list) and len(answer) == 1 else answer
    if not isinstance(text, str) or text not in eg["options"]:
        raise ValueError(f"infinitebench: {task} record {eg.get('id')}: answer {answer!r:.40} is not an option")
    return [text, OPTIONS[eg["options"].index(text)]]


@DATASETS.register("infinitebench")
@dataclass
class InfiniteBench(Dataset):
    name: str = "infinitebench"
    version: str = "1"
    root: str = "data/infinitebench"
    tasks: list[str] = field(default_factory=lambda: list(TAILORKV_TASKS))
    limit_per_task: int | None = None
    protocol: str = "tailorkv"            # tailorkv | official (truncation feed; default scorer)
    scorer: str | None = None             # official | tailorkv; null = the protocol's
    truncate_tokens: int | None = None    # null = the model's max_prompt_tokens (TailorKV: 131072 / Yi 200000)
    max_new_tokens: int | None = None     # null = upstream's per task
    primary_metric: str = "infinitebench"
    provenance: dict = field(default_factory=dict, init=False, repr=False)  # provenance.json, into the manifest

    def __post_init__(self) -> None:
        self.tasks = [str(t) for t in self.tasks]
        for task in self.tasks:
            if task not in TEMPLATES:
                raise ValueError("infinitebench: " + unknown_choice("task", task, list(TEMPLATES)))
        if self.protocol not in SCORERS:
            raise ValueError("infinitebench: " + unknown_choice("protocol", self.protocol, list(SCORERS)))
        self.scorer = self.scorer or self.protocol
        if self.scorer not in SCORERS:
            raise ValueError("infinitebench: " + unknown_choice("scorer", self.scorer, list(SCORERS)))

    def check(self) -> None:
        root = Path(self.root).expanduser()
        missing = [f"{t}.jsonl" for t in self.tasks if find_file(root, t) is None]
        if missing:
            raise FileNotFoundError(f"infinitebench: {root}/ lacks {', '.join(missing)}; {DOWNLOAD_HINT}.")

    def build(self, tokenizer, max_prompt_tokens: int | None = None, chat_template: bool = False) -> list[Sample]:
        self.check()
        self.provenance = read_provenance(self.root, self.name)
        limit = self.truncate_tokens or max_prompt_tokens
        samples = []
        for task in self.tasks:
            path = find_file(self.root, task)
            records = read_jsonl(path, {"context": str, "answer": (list, str, int, float)}, self.name)
            question = split_template(TEMPLATES[task])[1]  # query=agnostic: what follows {context}
            for index, eg in enumerate(records[: self.limit_per_task]):
                prompt = build_prompt(task, eg)
                ids = tokenizer.encode(prompt)
                n_full = len(ids)
                context_end = question_offset(prompt, question)
                n_context = None if context_end is None else context_token_count(tokenizer, prompt, context_end, ids)
                truncated = limit is not None and len(ids) > limit
                if truncated:
                    ids = middle_cut(ids, limit)
                    if n_context is not None:
                        n_context = cut_context(n_context, n_full, len(ids), limit // 2)
                    if self.protocol == "official":  # upstream decodes the cut tokens and tokenizes again
                        text = tokenizer.decode(ids, skip_special_tokens=True)
                        ids = tokenizer.encode(text)
                        at = question_offset(text, question) if context_end is not None else None
                        n_context = context_token_count(tokenizer, text, at, ids) if at is not None else None
                label = get_label(task, eg)
                answers = [str(a) for a in label] if isinstance(label, list) else [str(label)]
                samples.append(Sample(
                    id=f"{task}-{eg.get('id', index)}", prompt=prompt, answers=answers,
                    max_new_tokens=self.max_new_tokens or MAX_NEW_TOKENS[task], input_ids=tuple(ids),
                    context_end=context_end, context_tokens=n_context,
                    meta={"task": task, "index": index, "label": label, "truncated": truncated}))
        logger.info("infinitebench: %d samples from %d tasks (protocol %s, cut at %s tokens)", len(samples),
                    len(self.tasks), self.protocol, limit)
        return samples

    def score(self, sample: Sample, prediction: str) -> dict[str, float]:
        return {"infinitebench": score_one(sample.meta["task"], prediction.strip(), sample.meta["label"],
                                           self.scorer)}

    def summarize(self, records: list[dict]) -> dict:
        """Per task: mean x 100 (upstream get_score); `avg`: the mean of the task scores (TailorKV Table 15)."""
        tasks: dict[str, list[float]] = {}
        for r in records:
            tasks.setdefault(r["meta"]["task"], []).append(r["scores"]["infinitebench"])
        order = [t for t in self.tasks if t in tasks] + sorted(t for t in tasks if t not in self.tasks)
        table = {t: 100 * sum(tasks[t]) / len(tasks[t]) for t in order}
        return {"infinitebench": {"protocol": self.protocol, "scorer": self.scorer, "tasks": table,
                                  "n": {t: len(tasks[t]) for t in order},
                                  "avg": sum(table.values()) / len(table) if table else None}}
