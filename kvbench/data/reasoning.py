"""Long generation under compression (issue 32): MATH-500, AIME 2024 and AIME 2025, and the pass@1 all four report.

These sets stress what the prompt-side benchmarks do not: a short prompt and thousands of generated tokens, so the
cache grows while decoding and decode-time evictors (H2O, TOVA, the rolling windows) do most of the work.

Data: `<root>/test.jsonl` with the fields `problem` and `answer` (MATH-500 adds `solution`, `subject`, `level`,
`unique_id`; AIME 2024 `id`, `solution`, `url`, `year`), written by `scripts/download_reasoning.py` with the
source's revision in `<root>/provenance.json` (recorded in the manifest). Builders read only the local folder.

Prompts (`prompt=`), sent as the user turn of the model's chat template when `model.chat_template: true` (the
references all do; `thinking=` sets the template's `enable_thinking` where it has one, Qwen3; null = its default):
- `rkv`: R-KV's `run_math.py` template (Zefan-Cai/R-KV @ e9f54c4, HuggingFace/run_math.py `prompt_template`),
  byte for byte ("Final answer:  \\boxed{}" with its two spaces). Default of `aime24` (R-KV's set).
- `r1`: the problem, a newline, "Please reason step by step, and put your final answer within \\boxed{}." (the
  DeepSeek-R1 model card's advice; the convention of R1-style evaluations). Default of `math500` and `aime25`, whose
  reference is kvpress's evaluation/benchmarks: kvpress sends its dataset's `question` field alone
  (`aime25/evaluate_kvzap.py`: `[{"role": "user", "content": row["question"]}]`), but the text of that field in
  `alessiodevoto/aime25` / `alessiodevoto/math500` could not be read here (no Hub), so whether it carries an
  instruction is unverified; `prompt=kvpress` sends the bare problem, which equals kvpress only if it does not.
Generation ends at EOS or `max_new_tokens` (no stop strings): R-KV's caps (MATH-500 16384, AIME 2024 32768; R-KV
caps prompt + generation with `max_length`, kvbench the generation alone) and kvpress's AIME 2025 (32000).
Scores: `math_verify` (primary) and `answered` (kvpress's "boxed{" count), kvbench.metrics.reasoning.

pass@1 over n samples (`samples=n`, with `generation.do_sample=true`): each problem is run n times, sample ids
`<problem>#<k>` (each its own seed, `cfg.seed` mixed with the id); pass@1 = the mean over problems of each problem's
mean score, se = sd of those per-problem means / sqrt(number of problems) (the samples of one problem are not
independent draws of the benchmark, so the per-sample sd / sqrt(n * problems) would understate it). scores.json:
`reasoning.pass@1.<metric>`; `metrics`/`stats` keep the plain per-sample mean and its sd/sqrt(n) like every dataset.
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal, NamedTuple

import numpy as np

from kvbench.data.base import Dataset, Sample
from kvbench.data.jsonl import find_file, read_jsonl, read_provenance
from kvbench.metrics.reasoning import answered, math_verify
from kvbench.registry import DATASETS
from kvbench.metrics.stats import unit_mean_se

logger = logging.getLogger(__name__)

RKV_TEMPLATE = ("You are given a math problem.\n\nProblem: {question}\n\n You need to solve the problem step by step. "
                "First, you need to provide the chain-of-thought, then provide the final answer.\n\n Provide the final "
                "answer in the format: Final answer:  \\boxed{{}}")
R1_TEMPLATE = "{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
PROMPTS = {"rkv": RKV_TEMPLATE, "r1": R1_TEMPLATE, "kvpress": "{question}"}


def download_hint(name: str) -> str:
    return f"run `python scripts/download_reasoning.py {name}` (needs the Hugging Face Hub) or set dataset.root"


class Problem(NamedTuple):
    """One problem before it is repeated `samples` times."""
    id: str
    prompt: str
    answers: list[str]
    meta: dict
    context_end: int | None = None  # where its few-shot context ends (query=agnostic); None: no context


def pass_at_1(records: list[dict], metrics: tuple[str, ...]) -> dict:
    """Per metric: the mean over problems (`meta.problem`) of each problem's mean score, and the se over problems."""
    out = {}
    for metric in metrics:
        scored = [r for r in records if metric in r.get("scores", {})]
        est = unit_mean_se([r["scores"][metric] for r in scored], [r["meta"]["problem"] for r in scored])
        counts = list(Counter(r["meta"]["problem"] for r in scored).values())
        out[metric] = {"mean": est.mean, "se": est.se, "n_problems": est.n,
                       "samples_per_problem": [min(counts), max(counts)] if counts else None,
                       "se_method": "sd of per-problem means / sqrt(problems)"}
    return out


@dataclass
class Reasoning(Dataset):
    """Shared by the reasoning sets: the data folder, `samples` repeats, the thinking switch and the pass@1 summary.
    Subclasses give `problems()` and `score`."""

    name: str = ""
    version: str = "1"
    root: str = ""
    samples: int = 1                  # generations per problem (pass@1 over them); sampling: generation.do_sample
    thinking: bool | None = None      # chat template's enable_thinking (Qwen3); null: the template's default
    max_new_tokens: int = 1
    primary_metric: str = ""
    provenance: dict = field(default_factory=dict, init=False, repr=False)  # provenance.json, into the manifest
    pass_metrics: ClassVar[tuple[str, ...]] = ()
    stop: ClassVar[tuple[str, ...]] = ()
    files: ClassVar[tuple[str, ...]] = ("test",)

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ValueError(f"{self.name}: samples={self.samples} must be >= 1 (generations per problem)")

    def check(self) -> None:
        """One-line FileNotFoundError before weights load if a data file is missing."""
        root = Path(self.root).expanduser()
        missing = [f"{stem}.jsonl" for stem in self.files if find_file(root, stem) is None]
        if missing:
            raise FileNotFoundError(f"{self.name}: {root}/ lacks {', '.join(missing)}; {download_hint(self.name)}.")

    def read(self, stem: str, required: dict) -> list[dict]:
        return read_jsonl(find_file(self.root, stem), required, self.name)

    def problems(self) -> list[Problem]:  # pragma: no cover - interface
        raise NotImplementedError

    def chat_kwargs(self, tokenizer, chat_template: bool) -> dict:
        """`enable_thinking` for the chat template (setup refuses `thinking` without one)."""
        if self.thinking is None or not chat_template:
            return {}
        if "enable_thinking" not in str(getattr(tokenizer, "chat_template", None) or ""):
            logger.warning("%s: thinking=%s, but this tokenizer's chat template has no enable_thinking switch; it "
                           "renders as it always does", self.name, self.thinking)
        return {"enable_thinking": self.thinking}

    def build(self, tokenizer, max_prompt_tokens: int | None = None, chat_template: bool = False) -> list[Sample]:
        """Each problem `samples` times in a row (so `limit` = k * samples keeps k whole problems)."""
        self.check()
        self.provenance = read_provenance(self.root, self.name)
        kwargs = self.chat_kwargs(tokenizer, chat_template)
        samples = []
        for p in self.problems():
            for k in range(self.samples):
                samples.append(Sample(
                    id=f"{p.id}#{k}" if self.samples > 1 else p.id, prompt=p.prompt, answers=p.answers,
                    max_new_tokens=self.max_new_tokens, stop=self.stop, meta={**p.meta, "problem": p.id, "sample": k},
                    context_end=p.context_end, chat_template_kwargs=kwargs))
        logger.info("%s: %d problems x %d samples", self.name, len(samples) // self.samples, self.samples)
        return samples

    def summarize(self, records: list[dict]) -> dict:
        """pass@1 of each score with its se over problems, and the generation lengths (the point of these sets)."""
        if not records:
            return {}
        new_tokens = [r["new_tokens"] for r in records if "new_tokens" in r]
        return {"reasoning": {
            "pass@1": pass_at_1(records, self.pass_metrics), "samples": self.samples,
            "new_tokens_mean": float(np.mean(new_tokens)) if new_tokens else None,
            "new_tokens_max": max(new_tokens) if new_tokens else None,
            "cut_at_max_new_tokens": float(np.mean([n >= self.max_new_tokens for n in new_tokens]))
            if new_tokens else None}}


@dataclass
class MathProblems(Reasoning):
    """A competition-math set graded by math-verify (see the module docstring); sample ids `<name>-<index>`."""

    prompt: Literal["rkv", "r1", "kvpress"] = "r1"
    primary_metric: str = "math_verify"
    pass_metrics: ClassVar[tuple[str, ...]] = ("math_verify", "answered")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.prompt not in PROMPTS:
            raise ValueError(f"{self.name}: prompt={self.prompt!r} is not one of {', '.join(PROMPTS)}")

    def problems(self) -> list[Problem]:
        out = []
        for index, r in enumerate(self.read("test", {"problem": str, "answer": (str, int)})):
            source_id = r.get("unique_id", r.get("id"))
            meta = {"index": index, "source_id": source_id,
                    **{k: r[k] for k in ("subject", "level", "year") if k in r}}
            out.append(Problem(f"{self.name}-{index:03d}", PROMPTS[self.prompt].format(question=r["problem"]),
                               [str(r["answer"])], meta))
        return out

    def score(self, sample: Sample, prediction: str) -> dict[str, float]:
        return {"math_verify": math_verify(prediction, sample.answers),
                "answered": answered(prediction, sample.answers)}


@DATASETS.register("math500")
@dataclass
class Math500(MathProblems):
    name: str = "math500"
    root: str = "data/math500"
    max_new_tokens: int = 16384  # R-KV's MATH-500 cap (kvpress's own math500 set: 4096, unverified here)


@DATASETS.register("aime24")
@dataclass
class Aime24(MathProblems):
    name: str = "aime24"
    root: str = "data/aime24"
    prompt: Literal["rkv", "r1", "kvpress"] = "rkv"
    max_new_tokens: int = 32768  # R-KV's AIME 2024 cap


@DATASETS.register("aime25")
@dataclass
class Aime25(MathProblems):
    name: str = "aime25"
    root: str = "data/aime25"
    max_new_tokens: int = 32000  # kvpress aime25/evaluate_kvzap.py --max_new_tokens
