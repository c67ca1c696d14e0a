"""GSM8K as lm-evaluation-harness 0.4.13 runs it (`lm_eval/tasks/gsm8k/`), for long generation under compression.

Data: `<root>/test.jsonl` and, for `protocol=gsm8k`'s few-shot examples, `<root>/train.jsonl` (openai/gsm8k, config
`main`: fields `question`, `answer` = "<reasoning>\\n#### <number>"), written by `scripts/download_reasoning.py`.

Protocols (lm-eval's two tasks, prompts byte for byte):
- `gsm8k` (gsm8k.yaml, version 3.0): `"Question: {question}\\nAnswer:"`, 5 examples from the train split, each
  followed by " " + its whole answer and "\\n\\n"; the examples are drawn as lm-eval's default sampler draws them,
  `random.Random(1234).sample(train, 5)` for each test document in order from one generator, so document i gets
  the i-th draw (a single-process lm-eval run, any `--limit`; `fewshot_seed` is `--seed`'s fourth value).
- `gsm8k_cot` (gsm8k-cot.yaml, version 3.0): `"Q: {question}\\nA:"` after the 8 fixed chain-of-thought exemplars
  of Wei et al. (lm-eval's `first_n` sampler over `fewshot_config.samples`, below).
Stop strings: lm-eval's `until` ("Question:" or "Q:", "</s>", "<|im_end|>"; EOS ends it too); 256 new tokens
(lm-eval's `max_gen_toks` default); greedy. With `model.chat_template: true` the whole prompt is one user turn,
as lm-eval's `--apply_chat_template` without `--fewshot_as_multiturn` sends it. `query=agnostic`: the examples are
the context, the last question the question.
Scores: lm-eval's two filters through its exact match (kvbench.metrics.reasoning): `strict_match` (primary) and
`flexible_extract`; pass@1 over `samples` as the other reasoning sets (kvbench.data.reasoning).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar, Literal

from kvbench.data.base import Sample
from kvbench.data.reasoning import Problem, Reasoning
from kvbench.metrics.reasoning import gsm8k_scores
from kvbench.registry import DATASETS

TEMPLATES = {"gsm8k": "Question: {question}\nAnswer:", "gsm8k_cot": "Q: {question}\nA:"}
DEFAULT_SHOTS = {"gsm8k": 5, "gsm8k_cot": 8}
UNTIL = {"gsm8k": ("Question:", "</s>", "<|im_end|>"), "gsm8k_cot": ("Q:", "</s>", "<|im_end|>")}
# gsm8k-cot.yaml `fewshot_config.samples` (question, target), in order
COT_EXEMPLARS = (
    ("There are 15 trees in the grove. Grove workers will plant trees in the grove today. After they are done, there "
     "will be 21 trees. How many trees did the grove workers plant today?",
     "There are 15 trees originally. Then there were 21 trees after some more were planted. So there must have been "
     "21 - 15 = 6. The answer is 6."),
    ("If there are 3 cars in the parking lot and 2 more cars arrive, how many cars are in the parking lot?",
     "There are originally 3 cars. 2 more cars arrive. 3 + 2 = 5. The answer is 5."),
    ("Leah had 32 chocolates and her sister had 42. If they ate 35, how many pieces do they have left in total?",
     "Originally, Leah had 32 chocolates. Her sister had 42. So in total they had 32 + 42 = 74. After eating 35, they "
     "had 74 - 35 = 39. The answer is 39."),
    ("Jason had 20 lollipops. He gave Denny some lollipops. Now Jason has 12 lollipops. How many lollipops did Jason "
     "give to Denny?",
     "Jason started with 20 lollipops. Then he had 12 after giving some to Denny. So he gave Denny 20 - 12 = 8. The "
     "answer is 8."),
    ("Shawn has five toys. For Christmas, he got two toys each from his mom and dad. How many toys does he have now?",
     "Shawn started with 5 toys. If he got 2 toys each from his mom and dad, then that is 4 more toys. 5 + 4 = 9. The "
     "answer is 9."),
    ("There were nine computers in the server room. Five more computers were installed each day, from monday to "
     "thursday. How many computers are now in the server room?",
     "There were originally 9 computers. For each of 4 days, 5 more computers were added. So 5 * 4 = 20 computers "
     "were added. 9 + 20 is 29. The answer is 29."),
    ("Michael had 58 golf balls. On tuesday, he lost 23 golf balls. On wednesday, he lost 2 more. How many golf balls "
     "did he have at the end of wednesday?",
     "Michael started with 58 golf balls. After losing 23 on tuesday, he had 58 - 23 = 35. After losing 2 more, he had "
     "35 - 2 = 33 golf balls. The answer is 33."),
    ("Olivia has $23. She bought five bagels for $3 each. How much money does she have left?",
     "Olivia had 23 dollars. 5 bagels for 3 dollars each will be 5 x 3 = 15 dollars. So she has 23 - 15 dollars left. "
     "23 - 15 is 8. The answer is 8."),
)


@DATASETS.register("gsm8k")
@dataclass
class Gsm8k(Reasoning):
    """GSM8K test (1319 problems) under one lm-eval task; sample ids `gsm8k-<index>` (`#<k>` with samples > 1)."""

    name: str = "gsm8k"
    root: str = "data/gsm8k"
    protocol: Literal["gsm8k", "gsm8k_cot"] = "gsm8k"
    num_fewshot: int | None = None    # null: the task's (gsm8k 5, gsm8k_cot 8)
    fewshot_seed: int = 1234          # lm-eval's default fewshot_random_seed
    max_new_tokens: int = 256         # lm-eval's max_gen_toks default
    primary_metric: Literal["strict_match", "flexible_extract"] = "strict_match"
    pass_metrics: ClassVar[tuple[str, ...]] = ("strict_match", "flexible_extract")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.protocol not in TEMPLATES:
            raise ValueError(f"gsm8k: protocol={self.protocol!r} is not one of {', '.join(TEMPLATES)}")
        if self.num_fewshot is None:
            self.num_fewshot = DEFAULT_SHOTS[self.protocol]
        if self.protocol == "gsm8k_cot" and not 0 <= self.num_fewshot <= len(COT_EXEMPLARS):
            raise ValueError(f"gsm8k: num_fewshot={self.num_fewshot} must be in [0, {len(COT_EXEMPLARS)}] for "
                             "gsm8k_cot (its fixed exemplars)")
        self.stop = UNTIL[self.protocol]

    @property
    def files(self) -> tuple[str, ...]:
        return ("test", "train") if self.protocol == "gsm8k" and self.num_fewshot else ("test",)

    def problems(self) -> list[Problem]:
        template, fields = TEMPLATES[self.protocol], {"question": str, "answer": str}
        drawn = "train" in self.files  # gsm8k's examples come from the train split, gsm8k_cot's are fixed
        train = self.read("train", fields) if drawn else []
        if drawn and len(train) < self.num_fewshot:
            raise ValueError(f"gsm8k: num_fewshot={self.num_fewshot} exceeds the {len(train)} train records")
        rnd = random.Random(self.fewshot_seed)  # one generator for the whole test split, drawn in document order
        out = []
        for index, r in enumerate(self.read("test", fields)):
            if drawn:
                examples = [(d["question"], d["answer"]) for d in rnd.sample(train, self.num_fewshot)]
            else:
                examples = COT_EXEMPLARS[: self.num_fewshot] if self.protocol == "gsm8k_cot" else ()
            context = "".join(template.format(question=q) + " " + a + "\n\n" for q, a in examples)
            out.append(Problem(f"gsm8k-{index:04d}", context + template.format(question=r["question"]),
                               [r["answer"]], {"index": index, "protocol": self.protocol},
                               len(context) if context else None))
        return out

    def score(self, sample: Sample, prediction: str) -> dict[str, float]:
        return gsm8k_scores(prediction, sample.answers[0], self.protocol)
