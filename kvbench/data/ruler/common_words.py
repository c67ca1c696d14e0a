"""RULER's common words extraction `cwe` (upstream `scripts/data/synthetic/common_words_extraction.py` at c5341b4),
rewritten.

Kept as in the 2024 data: the pool is wonderwords' 8,169 words (so prompts past about 128K under-fill); the
one-shot example is rendered with the whole template and followed by its answer list glued to the answer prefix
(`...are:1. w`); below 4096 tokens the example has 20 words (3/1 repeats) and the sample repeats 6/1.
"""
from __future__ import annotations

import random

from kvbench.data.ruler.length import Counter, fit, linear_search
from kvbench.data.ruler.sources import cwe_words

INCREMENTAL = 10


def numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def generate(count: Counter, template: str, max_seq_length: int, tokens_to_generate: int, num_samples: int,
             random_seed: int, freq_cw: int, freq_ucw: int, num_cw: int) -> list[dict]:
    """Upstream records `{index, input, outputs, length}`; the answer is the `num_cw` common words."""
    rng = random.Random(random_seed)
    words = list(cwe_words())
    random.Random(random_seed).shuffle(words)

    def example(num_words: int, common_repeats: int, uncommon_repeats: int) -> tuple[str, list[str]]:
        full = rng.sample(words, num_words)
        common, uncommon = full[:num_cw], full[num_cw:]
        listing = common * int(common_repeats) + uncommon * int(uncommon_repeats)
        random.Random(random_seed).shuffle(listing)
        return numbered(listing), common

    def make_sample(num_words: int) -> tuple[str, list[str]]:
        if max_seq_length < 4096:
            context_example, answer_example = example(20, 3, 1)
            context, answer = example(num_words, 6, 1)
        else:
            context_example, answer_example = example(40, 10, 3)
            context, answer = example(num_words, freq_cw, freq_ucw)
        shot = template.format(context=context_example, query="") + numbered(answer_example)
        return shot + "\n" + template.format(context=context, query=""), answer

    def measure(n: int) -> int:
        text, answer = make_sample(n)
        return count(text + " " + numbered(answer))

    num_words = linear_search(measure, INCREMENTAL, max_seq_length - tokens_to_generate, cap=len(words))

    def attempt(n: int) -> dict:
        text, answer = make_sample(n)
        length = count(text) + tokens_to_generate
        if length > max_seq_length:
            raise ValueError(f"{length} exceeds max_seq_length.")
        return {"input": text, "outputs": answer, "length": length}

    return [{"index": i, **fit(attempt, num_words, INCREMENTAL, "cwe")} for i in range(num_samples)]
