"""SCBench (Li et al. 2024, "SCBench: A KV Cache-Centric Analysis of Long-Context Methods"; microsoft/MInference @
fb56c91, `scbench/`): one long context shared by several turns, for the six tasks that fit kvbench: retrieval
(`scbench_kv`, `scbench_prefix_suffix`), multi-turn QA over one book (`scbench_qa_eng`, `scbench_choice_eng`),
many-shot ICL (`scbench_many_shot`) and summarization (`scbench_summary`).

Data: the Hub dataset `microsoft/SCBench`, `data/<task>.jsonl`, one record per context: `id`, `context`,
`multi_turns` (a list of `{"input", "answer"}`, plus `options` for choice_eng), in a local folder (`dataset.root`;
`python scripts/download_scbench.py` or `make scbench-data`, which records the Hub revision and the commit read in
`provenance.json`, then the manifest).

Prompts (`eval_utils.py`, kvbench.data.scbench_prompts byte for byte). A record becomes a `Conversation`: segments of
text, each tokenized as upstream does, and one `Turn` per question.
- `mode=multi_turn` (upstream's default, `create_multiturn_prompt`): segment 0 is the context with the first
  question; segment i > 0 is the previous turn's *reference* answer followed by question i (upstream's golden
  context: the model's own answer is discarded). With the model's chat template: segment 0 is the user turn plus
  the generation prompt; segment i is [system "", assistant <answer i-1>, user <question i>] rendered with the
  generation prompt, minus the rendering of [system ""] (+ "This paper" for summary).
- `mode=scdq` (multi-request, `create_scdq_prompt`): segment 0 is the context alone; each query is appended to it
  alone (no separator without a chat template, as upstream). With a chat template upstream cuts the rendered
  prompts at a delimiter: the context ends inside the open user turn, each query closes it.
Segment 0 is tokenized with the tokenizer's special tokens (a BOS; with a chat template that already starts with one,
upstream gets two, and so does kvbench) and, if longer than `max_seq_length - max_new_tokens x turns` (scdq: 1000
fewer), cut in the middle (first and last half of the ids); later segments are tokenized without special tokens.
`max_seq_length: null` uses the model's `max_prompt_tokens` (upstream's runs: 131072). Greedy, EOS stop, the task's
new tokens per turn (`DATA_NAME_TO_MAX_NEW_TOKENS`).

Samples (`turn_mode`): null (default): each turn is its own sample whose `input_ids` are the ids SCBench's cache
holds when that turn is asked: multi_turn turn i = segments 0..i; scdq turn i = segment 0 + query i. With
`method=full` a sample's prediction is the one SCBench gets for that turn; a compressing method compresses those ids
once per turn. `reset` (mode scdq) and `append` (mode multi_turn with the model's own answers, upstream's
`--disable_golden_context`: later segments are the questions alone) make one conversation per context for
kvbench.engine.turns (`meta.conversation`, `meta.question` / `meta.followup`: the text fed for a later turn). Sample
ids `<task>-<record id>-t<turn>`; `meta`: task, index, turn, n_turns, mode, `prefix_tokens` (ids before this turn's
own segment: the shared part). `context_tokens` (query=agnostic): turn 0 and scdq queries split after the context
and the template's whitespace; a later multi_turn turn after its shared history.

Scores: kvbench.metrics.scbench (upstream's scorers, quirks documented there); scores.json: per task the score x 100
of each turn (upstream's per-turn accuracy), the task mean over turns, and `avg`, the mean of the task means.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from kvbench.data.base import Dataset, Sample, middle_cut
from kvbench.data.jsonl import read_jsonl, read_provenance
from kvbench.data.split import content_offset, context_token_count, cut_context, split_template
from kvbench.data.scbench_prompts import (
    CONTEXT_ONLY, FIRST_TURN, FOLLOW_UP, FOLLOW_UP_CHAT, MAX_NEW_TOKENS, SCDQ_DELIMITER, SUMMARY_CHAT_PRIMER, TASKS,
)
from kvbench.metrics.scbench import SCORERS, ground_truth, score_turn
from kvbench.metrics.stats import mean_se
from kvbench.registry import DATASETS, unknown_choice

logger = logging.getLogger(__name__)

DOWNLOAD_HINT = "run `python scripts/download_scbench.py` (or `make scbench-data`; needs the Hugging Face Hub)"
MODES = ("multi_turn", "scdq")
TURN_MODES = {None: ("multi_turn", "scdq"), "append": ("multi_turn",), "reset": ("scdq",)}  # turn_mode -> modes
CHOICE_TASKS = ("scbench_choice_eng",)
QUESTION_TASKS = ("scbench_qa_eng", "scbench_choice_eng")  # templates with {question} (and options) for {input}


@dataclass(frozen=True)
class Turn:
    """One question of a conversation: the text SCBench appends for it, its ids, its reference answer and label."""

    text: str
    ids: tuple[int, ...]
    answer: str
    label: object
    max_new_tokens: int


@dataclass(frozen=True)
class Conversation:
    """One SCBench record: the shared `context` (segment 0's text and ids; in multi_turn mode it holds the first
    question too, as upstream's first prefill does) and its turns. In multi_turn mode turn i > 0 is appended after
    turns 0..i-1; in scdq mode every turn is appended to the context alone."""

    id: str
    task: str
    index: int
    mode: str
    context: str
    context_ids: tuple[int, ...]
    turns: tuple[Turn, ...]
    truncated: bool
    n_context: int | None = None   # leading ids of `context_ids` before the first question (query=agnostic's split)

    def turn_ids(self, i: int) -> list[int]:
        """The ids SCBench's cache holds when turn i is answered (its own segment last)."""
        if self.mode == "scdq":
            return [*self.context_ids, *self.turns[i].ids]
        ids = list(self.context_ids)
        for turn in self.turns[1: i + 1]:
            ids.extend(turn.ids)
        return ids

    def turn_text(self, i: int) -> str:
        if self.mode == "scdq":
            return self.context + self.turns[i].text
        return self.context + "".join(t.text for t in self.turns[1: i + 1])


def question_fields(task: str, turn: dict) -> dict:
    """The template fields of one turn: `input`, or `question` (and the four options for choice_eng)."""
    if task not in QUESTION_TASKS:
        return {"input": turn["input"]}
    fields = {"question": turn["input"]}
    if task in CHOICE_TASKS:
        fields.update({f"OPTION_{k}": turn["options"][i] for i, k in enumerate("ABCD")})
    return fields


def render(tokenizer, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def multi_turn_texts(task: str, record: dict, tokenizer, chat: bool) -> list[str]:
    """Upstream `create_multiturn_prompt(..., disable_golden_context=False)`: the text of each turn's segment."""
    turns = record["multi_turns"]
    first = FIRST_TURN[task].format(context=record["context"], **question_fields(task, turns[0]))
    if not chat:
        return [first] + [FOLLOW_UP[task].format(pre_ans=turns[i - 1]["answer"], **question_fields(task, turns[i]))
                          for i in range(1, len(turns))]
    system_only = tokenizer.apply_chat_template([{"role": "system", "content": ""}], add_generation_prompt=True,
                                                tokenize=False)
    primer = SUMMARY_CHAT_PRIMER if task == "scbench_summary" else ""
    texts = [render(tokenizer, [{"role": "user", "content": first}])]
    for i in range(1, len(turns)):
        messages = [{"role": "system", "content": ""}, {"role": "assistant", "content": str(turns[i - 1]["answer"])},
                    {"role": "user", "content": FOLLOW_UP_CHAT[task].format(**question_fields(task, turns[i]))}]
        texts.append(render(tokenizer, messages).replace(system_only, "") + primer)
    return texts


def own_answer_texts(task: str, record: dict, tokenizer, chat: bool) -> list[str]:
    """Upstream `create_multiturn_prompt(..., disable_golden_context=True)`: segment 0 as in multi_turn mode; each
    later segment is the question alone (the model's own previous answer is already on the cache). With a chat
    template: [user <question>] rendered with the generation prompt, minus the rendering of [system ""] without one
    (upstream's rule: whether anything is removed depends on the template), + "This paper" for summary."""
    first = multi_turn_texts(task, {**record, "multi_turns": record["multi_turns"][:1]}, tokenizer, chat)
    questions = [FOLLOW_UP_CHAT[task].format(**question_fields(task, t)) for t in record["multi_turns"][1:]]
    if not chat:
        return first + questions
    system = tokenizer.apply_chat_template([{"role": "system", "content": ""}], add_generation_prompt=False,
                                           tokenize=False)
    primer = SUMMARY_CHAT_PRIMER if task == "scbench_summary" else ""
    return first + [render(tokenizer, [{"role": "user", "content": q}]).replace(system, "") + primer
                    for q in questions]


def first_question_at(task: str, record: dict, mode: str, text: str, tokenizer, chat: bool) -> int:
    """Where the first question starts in segment 0's text (characters): after the context and the whitespace that
    follows it in the template (`kvbench.data.split`); inside the rendered user turn with a chat template. In scdq
    mode segment 0 is the context alone: all of it."""
    if mode == "scdq":
        return len(text)
    head = split_template(FIRST_TURN[task])[0].format(context=record["context"])
    if not chat:
        return len(head)
    first = FIRST_TURN[task].format(context=record["context"], **question_fields(task, record["multi_turns"][0]))
    return content_offset(text, first) + len(head)


def scdq_texts(task: str, record: dict, tokenizer, chat: bool) -> list[str]:
    """Upstream `create_scdq_prompt`: the context prompt, then one query per turn."""
    context = CONTEXT_ONLY[task].format(context=record["context"])
    queries = [FOLLOW_UP_CHAT[task].format(**question_fields(task, t)) for t in record["multi_turns"]]
    if not chat:
        return [context, *queries]
    context = render(tokenizer, [{"role": "user", "content": context + SCDQ_DELIMITER}]).split(SCDQ_DELIMITER)[0]
    return [context, *(render(tokenizer, [{"role": "system", "content": ""},
                                          {"role": "user", "content": SCDQ_DELIMITER + q}]).split(SCDQ_DELIMITER)[1]
                       for q in queries)]


@DATASETS.register("scbench")
@dataclass
class SCBench(Dataset):
    """SCBench tasks from a local folder of the Hub's `data/<task>.jsonl` files (see the module docstring)."""

    name: str = "scbench"
    version: str = "1"
    root: str = "data/scbench"                 # folder with <task>.jsonl (the Hub dataset's data/ folder)
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    mode: str = "multi_turn"                   # multi_turn (upstream's default) | scdq (multi-request)
    turn_mode: str | None = None               # null: a sample per turn | append | reset: one conversation per context
    max_turns: int = 5                         # upstream --max_turns: the first N turns of every record
    limit_per_task: int | None = None          # upstream --num_eval_examples: the first N records of each task
    max_seq_length: int | None = None          # null = model.max_prompt_tokens (upstream's runs: 131072)
    max_new_tokens: int | None = None          # cap on every task's own new tokens (smoke runs); null = upstream's
    scorer: str = "official"                   # official | strict (many_shot's string label as one label)
    primary_metric: str = "scbench"
    provenance: dict = field(default_factory=dict, init=False, repr=False)  # provenance.json, into the manifest

    def __post_init__(self) -> None:
        self.tasks = [str(t) for t in self.tasks]  # Hydra hands over a ListConfig
        if not self.tasks:
            raise ValueError(f"scbench: tasks is empty; name some of {', '.join(TASKS)}.")
        for task in self.tasks:
            if task not in TASKS:
                raise ValueError("scbench: " + unknown_choice("task", task, list(TASKS)))
        if self.mode not in MODES:
            raise ValueError("scbench: " + unknown_choice("mode", self.mode, list(MODES)))
        if self.turn_mode not in TURN_MODES:
            raise ValueError(f"scbench: turn_mode={self.turn_mode!r} is not one of null, append, reset")
        if self.mode not in TURN_MODES[self.turn_mode]:
            raise ValueError(f"scbench: turn_mode={self.turn_mode} runs with mode={TURN_MODES[self.turn_mode][0]} "
                             f"(append: multi_turn with the model's own answers; reset: scdq), not mode={self.mode}")
        if self.scorer not in SCORERS:
            raise ValueError("scbench: " + unknown_choice("scorer", self.scorer, list(SCORERS)))
        for key in ("max_turns", "limit_per_task", "max_seq_length", "max_new_tokens"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"scbench: {key}={value!r} must be a positive integer"
                                 + ("." if key == "max_turns" else " or null."))

    @property
    def turns(self) -> int:
        """Questions a conversation feeds on top of one compressed cache (1: every turn is its own sample)."""
        return self.max_turns if self.turn_mode else 1

    # --- reading ----------------------------------------------------------------------------------------------

    def task_path(self, task: str) -> Path:
        return Path(self.root).expanduser() / f"{task}.jsonl"

    def check(self) -> None:
        """One line before weights load when the folder or a task file is missing."""
        root = Path(self.root).expanduser()
        if not root.is_dir():
            raise FileNotFoundError(f"scbench: no folder {root}/; {DOWNLOAD_HINT}, or set dataset.root=<folder with "
                                    "the <task>.jsonl files>.")
        missing = [f"{t}.jsonl" for t in self.tasks if not self.task_path(t).is_file()]
        if missing:
            raise FileNotFoundError(f"scbench: {root}/ lacks {', '.join(missing)}; {DOWNLOAD_HINT}.")

    def read_task(self, task: str) -> list[dict]:
        path = self.task_path(task)
        records = read_jsonl(path, {"context": str, "multi_turns": list}, self.name, line_key="_line")
        for r in records:
            where = f"scbench: {path}:{r['_line']}"
            if not r["multi_turns"] or not all(isinstance(t, dict) and isinstance(t.get("input"), str)
                                               and "answer" in t for t in r["multi_turns"]):
                raise ValueError(f"{where}: 'multi_turns' must be a non-empty list of {{input, answer}} objects")
            if task in CHOICE_TASKS and not all(isinstance(t.get("options"), list) and len(t["options"]) == 4
                                                and t["answer"] in t["options"] for t in r["multi_turns"]):
                raise ValueError(f"{where}: every turn needs 4 'options' that include its 'answer'")
        return records[: self.limit_per_task] if self.limit_per_task else records

    # --- building ---------------------------------------------------------------------------------------------

    def conversations(self, tokenizer, max_prompt_tokens: int | None = None,
                      chat_template: bool = False) -> list[Conversation]:
        """Every record of every task as a context and its turns, tokenized as upstream (module docstring)."""
        self.check()
        self.provenance = read_provenance(self.root, self.name)
        max_seq_length = self.max_seq_length or max_prompt_tokens or -1
        out = []
        for task in self.tasks:
            records = self.read_task(task)
            if not records:
                continue
            n_turns = min(len(records[0]["multi_turns"]), self.max_turns)  # upstream counts the first record's turns
            new_tokens = MAX_NEW_TOKENS[task]
            if max_seq_length > 0 and new_tokens >= max_seq_length:
                new_tokens = 500  # upstream's rule for a tiny max_seq_length
            limit = max_seq_length - new_tokens * n_turns - (1000 if self.mode == "scdq" else 0)
            if max_seq_length < 0:
                limit = -1
            for index, record in enumerate(records):
                record = {**record, "multi_turns": record["multi_turns"][: self.max_turns]}
                build_texts = (scdq_texts if self.mode == "scdq" else
                               own_answer_texts if self.turn_mode == "append" else multi_turn_texts)
                texts = build_texts(task, record, tokenizer, chat_template)
                full = tokenizer.encode(texts[0])
                context_ids = middle_cut(full, limit)
                at = first_question_at(task, record, self.mode, texts[0], tokenizer, chat_template)
                n_context = cut_context(context_token_count(tokenizer, texts[0], at, full), len(full),
                                        len(context_ids), max(limit, 0) // 2)
                turns = []
                for i, turn in enumerate(record["multi_turns"]):
                    text = texts[i + 1] if self.mode == "scdq" else (texts[i] if i else "")
                    ids = tokenizer.encode(text, add_special_tokens=False) if text else []
                    turns.append(Turn(text=text, ids=tuple(ids), answer=str(turn["answer"]),
                                      label=ground_truth(task, turn),
                                      max_new_tokens=min(new_tokens, self.max_new_tokens or new_tokens)))
                out.append(Conversation(id=f"{task}-{record.get('id', index)}", task=task, index=index,
                                        mode=self.mode, context=texts[0], context_ids=tuple(context_ids),
                                        turns=tuple(turns), truncated=len(context_ids) < len(full),
                                        n_context=n_context))
        return out

    def build(self, tokenizer, max_prompt_tokens: int | None = None, chat_template: bool = False) -> list[Sample]:
        """One sample per turn (see the module docstring), conversation by conversation, turns in order."""
        samples = []
        conversations = self.conversations(tokenizer, max_prompt_tokens, chat_template)
        for conv in conversations:
            for i, turn in enumerate(conv.turns):
                ids = conv.turn_ids(i)
                shared = len(ids) - len(turn.ids) if i or conv.mode == "scdq" else 0
                meta = {"task": conv.task, "index": conv.index, "turn": i, "n_turns": len(conv.turns),
                        "mode": conv.mode, "prefix_tokens": None if i and self.turn_mode == "append" else shared,
                        "truncated": conv.truncated}
                if conv.task in CHOICE_TASKS:
                    meta["letter"] = turn.label[1]
                # query=agnostic compresses what precedes this turn's question: the context (turn 0, scdq), or the
                # whole shared history (a later multi_turn turn)
                n_context = conv.n_context if (i == 0 or conv.mode == "scdq") else shared
                if self.turn_mode is not None:  # one conversation: the runner feeds turn i's text on the cache
                    meta.update(conversation=conv.id, turn_mode=self.turn_mode, question=turn.text, followup=turn.text)
                    if i:
                        samples.append(Sample(id=f"{conv.id}-t{i}", prompt=turn.text, answers=[turn.answer],
                                              max_new_tokens=turn.max_new_tokens, meta=meta))
                        continue
                samples.append(Sample(id=f"{conv.id}-t{i}", prompt=conv.turn_text(i), answers=[turn.answer],
                                      max_new_tokens=turn.max_new_tokens, meta=meta, input_ids=tuple(ids),
                                      context_tokens=n_context))
        logger.info("scbench: %d turns of %d contexts from %d tasks in %s (mode %s, chat template %s, %d cut)",
                    len(samples), len(conversations), len(self.tasks), self.root, self.mode,
                    "on" if chat_template else "off", sum(c.truncated for c in conversations))
        return samples

    # --- scoring ----------------------------------------------------------------------------------------------

    def score(self, sample: Sample, prediction: str) -> dict[str, float]:
        """Upstream's scorer for the task on the raw prediction, against `get_ground_truth`'s label."""
        task, answer = sample.meta["task"], sample.answers[0]
        label = ([answer, sample.meta["letter"]] if task in CHOICE_TASKS
                 else [answer] if task == "scbench_qa_eng" else answer)
        return {"scbench": score_turn(task, prediction, label, self.scorer)}

    def summarize(self, records: list[dict]) -> dict:
        """Per task: 100 x the mean score of each turn (upstream's per-turn accuracy) and over all turns (`tasks`),
        with standard errors; `avg`: the mean of the task scores present."""
        by_task: dict[str, dict[int, list[float]]] = {}
        for r in records:
            by_task.setdefault(r["meta"]["task"], {}).setdefault(r["meta"]["turn"], []).append(r["scores"]["scbench"])
        order = [t for t in self.tasks if t in by_task] + sorted(t for t in by_task if t not in self.tasks)
        per_turn = {t: {str(k): round(100 * sum(v) / len(v), 3) for k, v in sorted(by_task[t].items())}
                    for t in order}
        flat = {t: [s for k in sorted(by_task[t]) for s in by_task[t][k]] for t in order}
        tasks = {t: round(100 * sum(v) / len(v), 3) for t, v in flat.items()}
        tasks_se = {t: mean_se(v).scaled(100).se for t, v in flat.items()}
        return {"scbench": {"mode": self.mode, "scorer": self.scorer, "turns": per_turn, "tasks": tasks,
                            "tasks_se": {t: None if v is None else round(v, 4) for t, v in tasks_se.items()},
                            "n": {t: len(v) for t, v in flat.items()},
                            "avg": round(sum(tasks.values()) / len(tasks), 3) if tasks else None}}
