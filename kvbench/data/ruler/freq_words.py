"""RULER's frequent words extraction `fwe` (upstream `scripts/data/synthetic/freq_words_extraction.py` at c5341b4),
rewritten.

Word k of a shuffled random vocabulary appears `int(num_words * k**-alpha / zeta(alpha))` times; word 1 is "...",
the answer is words 2-4. Kept as in the 2024 data: the prompt fills up to max_seq_length *without* leaving room for
the 50 generated tokens (so `length` may exceed max_seq_length by up to 50), `vocab_size = max_seq_length // 50`,
and every sample draws a fresh vocabulary but reuses the word count found once.
"""
from __future__ import annotations

import random
import string

import numpy as np

from kvbench.data.ruler.length import Counter, NoFit


def generate(count: Counter, template: str, max_seq_length: int, tokens_to_generate: int, num_samples: int,
             random_seed: int, alpha: float, coded_wordlen: int = 6, vocab_size: int = -1) -> list[dict]:
    """Upstream records `{index, input, outputs, length}`."""
    from scipy.special import zeta

    rng = random.Random(random_seed)
    vocab_size = max_seq_length // 50 if vocab_size == -1 else vocab_size
    if vocab_size < 2:  # upstream: an IndexError (no word) or a sample with no answer (only the noise word "...")
        raise NoFit(f"ruler: fwe: max_seq_length={max_seq_length} gives a vocabulary of {vocab_size} word(s) "
                    "(length // 50), nothing to ask for; raise dataset.length.")
    max_len, incremental = max_seq_length, max_seq_length // 32

    def make_sample(num_words: int = -1) -> tuple[str, list[str], int]:
        vocab = ["".join(rng.choices(string.ascii_lowercase, k=coded_wordlen)) for _ in range(vocab_size)]
        while len(set(vocab)) < vocab_size:
            vocab.append("".join(rng.choices(string.ascii_lowercase, k=coded_wordlen)))
        vocab = sorted(set(vocab))
        random.Random(random_seed).shuffle(vocab)
        vocab[0] = "..."   # the most frequent word is noise

        def text_of(n: int) -> tuple[str, list[str]]:
            k = np.arange(1, len(vocab) + 1)
            counts = (n * (k ** -alpha) / zeta(alpha)).astype(int)
            words = [w for w, c in zip(vocab, counts) for _ in range(c)]
            random.Random(random_seed).shuffle(words)
            return template.format(context=" ".join(words), query=""), vocab[1:4]

        if num_words > 0:
            text, answer = text_of(num_words)
            while count(text) > max_len:
                if num_words <= 0:  # the bare template is over the length: upstream shrinks forever
                    raise NoFit(f"ruler: fwe: the template alone is over max_seq_length={max_seq_length}; raise "
                                "dataset.length.")
                num_words -= incremental
                text, answer = text_of(num_words)
        else:
            num_words = max_len // coded_wordlen
            text, answer = text_of(num_words)
            while count(text) < max_len:
                num_words += incremental
                text, answer = text_of(num_words)
            num_words -= incremental
        text, answer = text_of(num_words)
        return text, answer, num_words

    _, _, num_words = make_sample()
    out = []
    for index in range(num_samples):
        text, answer, _ = make_sample(num_words)
        out.append({"index": index, "input": text, "outputs": answer, "length": count(text) + tokens_to_generate})
    return out
