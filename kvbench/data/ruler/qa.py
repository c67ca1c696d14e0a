"""RULER's `qa_1` (SQuAD v2 dev) and `qa_2` (HotpotQA dev distractor) (upstream `scripts/data/synthetic/qa.py`
at c5341b4), rewritten.

Sample i asks question i of the file (answerable ones only for SQuAD); its documents are its own, then the other
paragraphs of its article (SQuAD), then random others up to `num_docs`, shuffled by a fresh `Random(seed)`, so the
gold document sits at the same position in every sample of a length. Kept as in the 2024 data: the search measures
the prompt plus the *repr* of the answer list, and when `num_docs` reaches the number of documents the shared list
itself is shuffled in place (so later samples start from the previous order).
"""
from __future__ import annotations

import random
from pathlib import Path

from kvbench.data.ruler.length import Counter, fit, linear_search
from kvbench.data.ruler.sources import READERS

INCREMENTAL = 10
DOCUMENT_PROMPT = "Document {i}:\n{document}"


def generate(count: Counter, template: str, max_seq_length: int, tokens_to_generate: int, num_samples: int,
             random_seed: int, dataset: str, qa_path: Path, pre_samples: int = 0) -> list[dict]:
    """Upstream records `{index, input, outputs, length}` for questions pre_samples .. pre_samples + num_samples."""
    rng = random.Random(random_seed)
    qas, docs = READERS[dataset](qa_path)
    if pre_samples + num_samples > len(qas):
        raise ValueError(f"ruler: {qa_path} has {len(qas)} usable questions; num_samples={num_samples} asks for "
                         f"{pre_samples + num_samples}.")

    def make_sample(index: int, num_docs: int) -> tuple[str, list[str]]:
        qa = qas[index]
        own, more = qa["context"], qa.get("more_context", [])
        if num_docs < len(docs):
            if num_docs - len(own) > len(more):
                others = [i for i, _ in enumerate(docs) if i not in own + more]
                picked = own + more + rng.sample(others, max(0, num_docs - len(own) - len(more)))
            else:
                picked = own + rng.sample(more, num_docs - len(own))
            chosen = [docs[i] for i in picked]
        else:
            chosen = docs   # upstream shuffles the shared list itself here
        random.Random(random_seed).shuffle(chosen)
        context = "\n\n".join(DOCUMENT_PROMPT.format(i=i + 1, document=d) for i, d in enumerate(chosen))
        return template.format(context=context, query=qa["query"]), qa["outputs"]

    def measure(n: int) -> int:
        text, answer = make_sample(0, n)
        return count(text + f" {answer}")   # the list's repr, as upstream

    num_docs = linear_search(measure, INCREMENTAL, max_seq_length - tokens_to_generate, cap=len(docs))

    def attempt(index: int):
        def build(n: int) -> dict:
            text, answer = make_sample(index, n)
            length = count(text) + tokens_to_generate
            if length > max_seq_length:
                raise ValueError(f"{length} exceeds max_seq_length.")
            return {"input": text, "outputs": answer, "length": length}
        return build

    return [{"index": i, **fit(attempt(i + pre_samples), num_docs, INCREMENTAL, dataset)} for i in range(num_samples)]
