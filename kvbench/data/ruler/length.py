"""Length targeting as RULER's 2024 generators do it: count tokens with the evaluated model's tokenizer, grow the
haystack linearly until the prompt no longer fits, step back once, then retry each sample with a smaller haystack
until it fits.

Counting (`scripts/data/tokenizer.py`, `hf` type): `len(tokenizer.tokenize(text))`, i.e. no BOS or other special
tokens, over the whole prompt (model template, task template and answer prefix included). The linear search
under-fills by up to one increment; that, not a bug, is what makes a 2024 sample.
"""
from __future__ import annotations

import hashlib
import logging
from typing import Callable, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")

Counter = Callable[[str], int]
MAX_STUCK = 100   # upstream retries forever at the smallest haystack; kvbench gives up after this many tries


class NoFit(RuntimeError):
    """No sample of a task can be built at this length (upstream loops forever or builds one with no answer)."""


def token_counter(tokenizer) -> Counter:
    """`len(tokenizer.tokenize(text))`: RULER's `HFTokenizer.text_to_tokens`. Any object with `tokenize` works
    (tests use a whitespace stand-in, `str.split`)."""
    tokenize = tokenizer.tokenize
    return lambda text: len(tokenize(text))


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash that changes whenever tokenization could: the full serialized fast tokenizer (model, merges,
    normalizer, pre-tokenizer, added tokens) when there is one, else the class, name and vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        text = backend.to_str()
    elif hasattr(tokenizer, "get_vocab"):
        vocab = sorted(tokenizer.get_vocab().items())
        text = f"{type(tokenizer).__qualname__}|{getattr(tokenizer, 'name_or_path', '')}|{vocab}"
    else:
        text = f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}|{getattr(tokenizer, 'fingerprint', '')}"
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def linear_search(measure: Callable[[int], int], incremental: int, budget: int, cap: int | None = None,
                  cap_before_step: bool = False) -> int:
    """Upstream's search for the haystack size: start at `incremental` units, measure the prompt (its tokens, with
    the answer appended as upstream does), add `incremental` while it stays under `budget` (= max_seq_length minus
    tokens_to_generate, minus a few-shot example for VT), and step back once when it goes over.

    Quirk kept: a prompt that lands exactly on the budget ends the loop *after* the step up, so the samples start one
    increment too high and shrink in `fit`. `cap` stops at the source's size, checked before the step (NIAH essay)
    or after it (CWE words, QA documents), as in each generator.
    """
    n, total = incremental, 0
    while total < budget:
        total = measure(n)
        if total > budget:
            return n - incremental
        if cap is not None and cap_before_step and n > cap:
            return cap
        n += incremental
        if cap is not None and not cap_before_step and n > cap:
            return cap
    return n


def fit(attempt: Callable[[int], T], start: int, incremental: int, what: str) -> T:
    """Upstream's per-sample loop: `attempt(n)` builds a sample with n units and raises if it does not fit (or cannot
    be built); on failure n shrinks by `incremental` while it is above `incremental`, else the same n is tried again
    (new random draws may fit). Upstream loops forever there; kvbench raises after MAX_STUCK tries."""
    n, stuck = start, 0
    while True:
        try:
            return attempt(n)
        except Exception as e:  # upstream: a bare `except:` around generation and the length assertion
            if n > incremental:
                n -= incremental
                continue
            stuck += 1
            if stuck >= MAX_STUCK:
                raise NoFit(f"ruler: {what}: no sample fits even at the smallest haystack ({n} units) after "
                                   f"{MAX_STUCK} tries (last error: {e}); raise dataset.length.") from e


def smallest_fitting(builds: Callable[[int], bool], too_small: int, cap: int) -> int | None:
    """The smallest length above `too_small` at which `builds(length)` holds: doubling up to `cap`, then bisection
    (None if nothing up to `cap` builds). Whether a length builds is close to monotone in it (the search and the
    draws start from the same seed), so the answer is a length that builds whose predecessor does not."""
    lo, hi = too_small, min(max(2 * too_small, 1), cap)
    while not builds(hi):
        if hi >= cap:
            return None
        lo, hi = hi, min(2 * hi, cap)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if builds(mid) else (mid, hi)
    return hi
