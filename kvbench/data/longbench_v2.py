"""LongBench v2 (arXiv 2412.15204): 503 four-choice questions over 8k-2M-word contexts, as THUDM/LongBench's v2 code
runs them (top level of THUDM/LongBench @ 2e00731: `pred.py`, `prompts/*.txt`, `result.py`).

Data: `<root>/data.jsonl`, one record per question with the source's fields (`_id`, `domain`, `sub_domain`,
`difficulty` easy|hard, `length` short|medium|long, `question`, `choice_A`..`choice_D`, `answer` A-D, `context`),
written by `scripts/download_longbench_v2.py` from the Hub's THUDM/LongBench-v2 at a pinned commit (provenance.json,
into the manifest).

Prompts (`prompt=`), byte for byte (sha256 of each upstream file pinned in tests/unit/test_long_context_data.py):
- `0shot` (default): `prompts/0shot.txt`; pred.py's `max_new_tokens=128`.
- `cot`: `prompts/0shot_cot.txt` ("Let’s think step by step:", with its curly apostrophe), 1024 new tokens; then,
  as pred.py, a second question (`follow_up`): `prompts/0shot_cot_ans.txt` (no document, the first reply stripped
  and pasted in for `$COT$`, filled last), cut and sent as a chat turn like the first, `cot_answer_max_new_tokens`
  (pred.py: 128) new tokens; the letter is read from that second reply. pred.py's second call is an independent
  request to the same server, so kvbench runs it as a new request of its own through the same method, with the
  budget (or `ratio`) applied to that prompt (kvbench.runs.follow_up). The record keeps both replies. Difference:
  pred.py drops a question whose reply is empty (its sign of a failed API call); kvbench asks and scores it anyway.
- `kvpress`: kvpress's reading (`evaluation/benchmarks/longbenchv2/create_huggingface_dataset.py` @ 8bb29b9): its
  context/question templates (no blank line after the first sentence, no `.strip()` of the fields, the final quote
  missing), kvpress's layout (kvbench.data.kvpress_layout: context cut to its head, the chat turn split at the
  question), 16 new tokens and kvpress's judge (`protocol=kvpress`, set by this prompt).
Fields are filled as pred.py does: `.replace()` in the order $DOC$, $Q$, $C_A$..$C_D$ on stripped values (a `$Q$`
inside a document is replaced too, as upstream). Truncation (not `kvpress`): if the prompt has more than
`model.max_prompt_tokens` tokens (default special tokens counted), keep the first `max // 2` and the last
`-max // 2` ids (Python's floor: one more than half for an odd limit), decoded with special tokens skipped; then the
chat template when `model.chat_template` is on (pred.py always sends a chat turn through vLLM's server).
Decoding: pred.py samples at temperature 0.1; kvbench decodes as `generation` says (greedy by default).
Scores: `accuracy` (pred.py's `judge`, 1 or 0) per question; `summarize` adds result.py's table: Overall, Easy, Hard,
Short, Medium, Long, each round(100 * mean, 1) (result.py's `compensated=False`: no 0.25 for unanswered).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NamedTuple

from kvbench.data.base import Dataset, Sample
from kvbench.data.jsonl import check_unique, find_file, read_jsonl, read_provenance
from kvbench.data.kvpress_layout import kvpress_layout
from kvbench.data.split import content_offset, context_token_count
from kvbench.metrics.longbench_v2 import extract_answer, kvpress_match
from kvbench.registry import DATASETS, unknown_choice

logger = logging.getLogger(__name__)

DOWNLOAD_HINT = "run `python scripts/download_longbench_v2.py` (needs the Hugging Face Hub) or set dataset.root"
CHOICES = ("A", "B", "C", "D")
REQUIRED = {"_id": str, "question": str, "context": str, "answer": str, "difficulty": str, "length": str,
            **{f"choice_{c}": str for c in CHOICES}}

_QUESTION = ("What is the correct answer to this question: $Q$\nChoices:\n(A) $C_A$\n(B) $C_B$\n(C) $C_C$\n"
             "(D) $C_D$\n\n")
_FORMAT = "Format your response as follows: \"The correct answer is (insert answer here)\"."
TEMPLATE_0SHOT = ("Please read the following text and answer the question below.\n\n<text>\n$DOC$\n</text>\n\n"
                  + _QUESTION + _FORMAT)
TEMPLATE_COT = ("Please read the following text and answer the questions below.\n\n<text>\n$DOC$\n</text>\n\n"
                + _QUESTION + "Let’s think step by step:")
# the second CoT question's own question: what comes before it (the question, the reasoning) is its context
COT_ANSWER_ASK = "Based on the above, what is the single, most likely answer choice? "
COT_ANSWER_TEMPLATE = ("Please read the following text and answer the questions below.\n\nThe text is too long and "
                       "omitted here.\n\n" + _QUESTION + "Let’s think step by step: $COT$\n\n" + COT_ANSWER_ASK
                       + _FORMAT)
# kvpress's split templates (str.format fields), byte for byte
KVPRESS_CONTEXT = "Please read the following text and answer the question below.\n<text>\n{context}\n</text>\n\n"
KVPRESS_QUESTION = ("What is the correct answer to this question: {question}\nChoices:\n(A) {A}\n(B) {B}\n(C) {C}\n"
                    "(D) {D}\n\nFormat your response as follows: \"The correct answer is (insert answer here).")


class Prompt(NamedTuple):
    template: str | None
    max_new_tokens: int


PROMPTS = {"0shot": Prompt(TEMPLATE_0SHOT, 128), "cot": Prompt(TEMPLATE_COT, 1024), "kvpress": Prompt(None, 16)}
DIFFICULTIES = ("easy", "hard")
LENGTHS = ("short", "medium", "long")


def fill(template: str, record: dict) -> str:
    """pred.py's chained `.replace()` on stripped fields, in its order (the second CoT question's `$COT$` comes
    after these: `LongBenchV2.follow_up`)."""
    text = template.replace("$DOC$", record["context"].strip()).replace("$Q$", record["question"].strip())
    for c in CHOICES:
        text = text.replace(f"$C_{c}$", record[f"choice_{c}"].strip())
    return text


def middle_cut(tokenizer, prompt: str, limit: int | None) -> tuple[str, bool]:
    """pred.py `query_llm`: over `limit` tokens, keep ids[:limit // 2] + ids[-limit // 2:], decoded without
    special tokens."""
    ids = tokenizer.encode(prompt)
    if limit is None or len(ids) <= limit:
        return prompt, False
    return tokenizer.decode(ids[:limit // 2] + ids[-limit // 2:], skip_special_tokens=True), True


def chat_turn(tokenizer, prompt: str, chat_template: bool) -> tuple[str, list[int], dict]:
    """(text, ids, tokenizer kwargs) of a prompt as the model reads it: pred.py sends each one as a user turn
    (vLLM's chat endpoint), so the chat template applies when the model config turns it on."""
    if not chat_template:
        return prompt, tokenizer(prompt).input_ids, {}
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    kwargs = {"add_special_tokens": False}
    return text, tokenizer(text, **kwargs).input_ids, kwargs


def split_at(tokenizer, prompt: str, text: str, ids: list[int], kwargs: dict,
             at: int) -> tuple[int | None, int | None]:
    """(context tokens, context characters of `text`) for a question that begins at `prompt[at:]` (`text` is `prompt`
    as the model reads it); (None, None) where `at` < 0: a middle cut took the boundary, no split."""
    if at < 0:
        return None, None
    at = content_offset(text, prompt) + at
    return context_token_count(tokenizer, text, at, ids, **kwargs), at


def result_table(records: list[dict]) -> dict:
    """result.py's row from records (`scores.accuracy`, `meta.difficulty`, `meta.length`): Overall, Easy, Hard, Short,
    Medium, Long as round(100 * mean, 1), None for an empty group (result.py divides by zero there); and `n` per
    group."""
    order = ("Overall", "Easy", "Hard", "Short", "Medium", "Long")
    groups: dict[str, list[float]] = {k: [] for k in order}
    for r in records:
        value, length = r["scores"]["accuracy"], r["meta"]["length"]
        groups["Overall"].append(value)
        groups["Easy" if r["meta"]["difficulty"] == "easy" else "Hard"].append(value)  # result.py: else hard
        groups[{"short": "Short", "medium": "Medium"}.get(length, "Long")].append(value)
    return {"scores": {k: round(100 * sum(v) / len(v), 1) if v else None for k, v in groups.items()},
            "n": {k: len(v) for k, v in groups.items()}}


@DATASETS.register("longbench_v2")
@dataclass
class LongBenchV2(Dataset):
    """LongBench v2 from a local folder; sample ids `longbench_v2-<_id>`. See the module docstring."""

    name: str = "longbench_v2"
    version: str = "2"
    root: str = "data/longbench_v2"
    prompt: Literal["0shot", "cot", "kvpress"] = "0shot"
    difficulty: list[str] = field(default_factory=lambda: list(DIFFICULTIES))  # keep these questions only
    lengths: list[str] = field(default_factory=lambda: list(LENGTHS))
    max_new_tokens: int | None = None              # null: the prompt's own (128, 1024, kvpress 16)
    cot_answer_max_new_tokens: int = 128           # prompt=cot: the second question's (pred.py's 128)
    primary_metric: str = "accuracy"
    provenance: dict = field(default_factory=dict, init=False, repr=False)
    cot_questions: dict = field(default_factory=dict, init=False, repr=False)  # id -> the second question but $COT$

    def __post_init__(self) -> None:
        self.difficulty, self.lengths = [str(d) for d in self.difficulty], [str(x) for x in self.lengths]
        if self.prompt not in PROMPTS:
            raise ValueError("longbench_v2: " + unknown_choice("prompt", self.prompt, list(PROMPTS)))
        for key, allowed in (("difficulty", DIFFICULTIES), ("lengths", LENGTHS)):
            for value in getattr(self, key):
                if value not in allowed:
                    raise ValueError(f"longbench_v2: {key} has {value!r}; use some of {', '.join(allowed)}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"longbench_v2: max_new_tokens={self.max_new_tokens} must be >= 1 or null")
        if self.cot_answer_max_new_tokens < 1:
            raise ValueError(f"longbench_v2: cot_answer_max_new_tokens={self.cot_answer_max_new_tokens} must be >= 1")

    def check(self) -> None:
        if find_file(self.root, "data") is None:
            raise FileNotFoundError(f"longbench_v2: {Path(self.root).expanduser()}/ lacks data.jsonl; {DOWNLOAD_HINT}.")

    def records(self) -> list[dict]:
        path = find_file(self.root, "data")
        records = read_jsonl(path, REQUIRED, self.name, line_key="_line")
        for r in records:
            if r["answer"] not in CHOICES or r["difficulty"] not in DIFFICULTIES or r["length"] not in LENGTHS:
                raise ValueError(f"longbench_v2: {path}:{r['_line']}: answer must be one of A-D, difficulty one of "
                                 f"{', '.join(DIFFICULTIES)}, length one of {', '.join(LENGTHS)}; got "
                                 f"{r['answer']!r}, {r['difficulty']!r}, {r['length']!r}")
        check_unique(records, "_id", path, self.name)
        return [r for r in records if r["difficulty"] in self.difficulty and r["length"] in self.lengths]

    def encode(self, tokenizer, record: dict, limit: int | None, chat_template: bool):
        """(text, ids, context tokens, context characters, truncated) for one record under the chosen prompt."""
        if self.prompt == "kvpress":
            context = KVPRESS_CONTEXT.format(context=record["context"])
            question = KVPRESS_QUESTION.format(question=record["question"],
                                               **{c: record[f"choice_{c}"] for c in CHOICES})
            out = kvpress_layout(tokenizer, context, question, "", chat_template, limit)
            return out.text, out.ids, out.context_tokens, out.context_chars, out.truncated
        prompt, truncated = middle_cut(tokenizer, fill(PROMPTS[self.prompt].template, record), limit)
        text, ids, kwargs = chat_turn(tokenizer, prompt, chat_template)
        at = prompt.rfind("</text>\n\n")  # the question begins after the document's closing tag
        at = at + len("</text>\n\n") if at >= 0 else at
        n_context, context_end = split_at(tokenizer, prompt, text, ids, kwargs, at)
        return text, tuple(ids), n_context, context_end, truncated

    def build(self, tokenizer, max_prompt_tokens: int | None = None, chat_template: bool = False) -> list[Sample]:
        self.check()
        self.provenance = read_provenance(self.root, self.name)
        max_new = self.max_new_tokens or PROMPTS[self.prompt].max_new_tokens
        samples, n_cut = [], 0
        for index, r in enumerate(self.records()):
            text, ids, n_context, context_end, truncated = self.encode(tokenizer, r, max_prompt_tokens, chat_template)
            n_cut += truncated
            meta = {"index": index, "difficulty": r["difficulty"], "length": r["length"], "truncated": truncated,
                    **{k: r[k] for k in ("domain", "sub_domain") if k in r}}
            if self.asks_follow_up:
                self.cot_questions[f"longbench_v2-{r['_id']}"] = fill(COT_ANSWER_TEMPLATE, r)
            samples.append(Sample(id=f"longbench_v2-{r['_id']}", prompt=text, answers=[r["answer"]],
                                  max_new_tokens=max_new, meta=meta, input_ids=ids, context_tokens=n_context,
                                  context_end=context_end))
        logger.info("longbench_v2: %d questions (prompt %s, %d truncated to %s tokens)", len(samples), self.prompt,
                    n_cut, max_prompt_tokens)
        return samples

    def score(self, sample: Sample, prediction: str) -> dict[str, float]:
        answer = sample.answers[0]
        if self.prompt == "kvpress":
            return {"accuracy": float(kvpress_match(prediction, answer))}
        letter = extract_answer(prediction)
        return {"accuracy": float(letter == answer), "answered": float(letter is not None)}

    @property
    def asks_follow_up(self) -> bool:
        return self.prompt == "cot"

    def follow_up(self, sample: Sample, reply: str, tokenizer, max_prompt_tokens: int | None,
                  chat_template: bool) -> Sample:
        """pred.py's second CoT question after `reply`: middle-cut and sent as a chat turn like the first."""
        prompt, truncated = middle_cut(tokenizer, self.cot_questions[sample.id].replace("$COT$", reply.strip()),
                                       max_prompt_tokens)
        text, ids, kwargs = chat_turn(tokenizer, prompt, chat_template)
        n_context, context_end = split_at(tokenizer, prompt, text, ids, kwargs, prompt.rfind(COT_ANSWER_ASK))
        return Sample(id=sample.id, prompt=text, answers=sample.answers, max_new_tokens=self.cot_answer_max_new_tokens,
                      meta={"truncated": truncated}, input_ids=tuple(ids), context_end=context_end,
                      context_tokens=n_context)

    def summarize(self, records: list[dict]) -> dict:
        done = [r for r in records if "accuracy" in r.get("scores", {})]
        return {"longbench_v2": {"prompt": self.prompt, **result_table(done)}} if done else {}
