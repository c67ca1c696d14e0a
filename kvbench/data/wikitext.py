"""Wikitext-2 perplexity (`wikitext_ppl`): BUZZ's streaming perplexity, or ordinary chunked perplexity (`mode=`).

Data: `wikitext` (now `Salesforce/wikitext`), `wikitext-2-raw-v1`, validation split, as a local `<split>.jsonl` with
the field `text` (one line per row, empty rows included, as the Hub ships them); `scripts/download_seed_tasks.py`
writes it, with `provenance.json` (the revision and commit read), which goes into the manifest.

- `mode=stream` (BUZZ `eval_long_ppl.py`, JunqiZhao888/buzz-llm @ e6f5e3e): the first `num_rows` rows (BUZZ: 40,
  empty rows included; they hold no token pair) are each tokenized with the tokenizer's default special tokens (a
  BOS where it adds one) and streamed one token at a time through ONE cache that is never reset, so eviction happens
  during the stream (kvbench.engine.perplexity). A record is one stream: `rows_per_record` rows (null = all rows in one
  record, BUZZ's setting). A record is atomic: resume skips finished streams and restarts an unfinished one from its
  first row, since a cache cannot be resumed halfway. Metric `ppl_stream`.
- `mode=chunked`: the rows joined by "\\n\\n" and tokenized once (HF's perplexity guide), cut into non-overlapping
  windows of `window` tokens (a shorter last window is kept if it has more than `context` tokens); in each window
  the first `context` tokens are prefilled and compressed by the method, the rest are scored one token at a time.
  One record per window. Metric `ppl_chunked`.
A run's PPL is exp(total NLL / total predicted tokens) over its records (`scores.json: perplexity.ppl`); each
record also carries its own.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Mapping

from kvbench.data.base import Dataset, Sample
from kvbench.data.jsonl import find_file, read_jsonl, read_provenance
from kvbench.metrics.stats import exp_of_ratio
from kvbench.registry import DATASETS

logger = logging.getLogger(__name__)

MODES = ("stream", "chunked")
DOWNLOAD_HINT = ("run `python scripts/download_seed_tasks.py wikitext_ppl` (needs the Hugging Face Hub) "
                 "or set dataset.root")


@DATASETS.register("wikitext_ppl")
@dataclass
class WikitextPPL(Dataset):
    name: str = "wikitext_ppl"
    version: str = "1"
    root: str = "data/wikitext_ppl"
    split: str = "validation"
    mode: str = "stream"
    num_rows: int | None = 40          # first N rows (BUZZ: 40); null = the whole split
    rows_per_record: int | None = None  # stream: rows per independent stream (null = one stream)
    window: int = 1024                  # chunked: tokens per window
    context: int = 512                  # chunked: prefilled (and compressed) tokens per window
    primary_metric: str = ""
    provenance: dict = field(default_factory=dict, init=False, repr=False)  # provenance.json, into the manifest
    kind: str = "perplexity"            # tells kvbench.run to teacher-force instead of generating
    # the run's token-weighted PPL in scores.json metrics/stats, with a bootstrap se over records
    corpus_metrics: ClassVar[Mapping] = {"ppl": exp_of_ratio("nll_sum", "n_tokens")}

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"wikitext_ppl: mode={self.mode!r} is not one of {', '.join(MODES)}")
        for key in ("num_rows", "rows_per_record"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"wikitext_ppl: {key}={value} must be >= 1 or null.")
        if self.mode == "chunked" and not 1 <= self.context < self.window:
            raise ValueError(f"wikitext_ppl: context={self.context} must be in [1, window={self.window}).")
        self.primary_metric = f"ppl_{self.mode}"

    def check(self) -> None:
        if find_file(self.root, self.split) is None:
            raise FileNotFoundError(f"wikitext_ppl: no {self.split}.jsonl in {Path(self.root).expanduser()}/; "
                                    f"{DOWNLOAD_HINT}=<folder with {self.split}.jsonl>.")

    def rows(self) -> list[str]:
        path = find_file(self.root, self.split)
        return [r["text"] for r in read_jsonl(path, {"text": str}, self.name)][: self.num_rows]

    def build(self, tokenizer, max_prompt_tokens: int | None = None, chat_template: bool = False) -> list[Sample]:
        self.check()
        self.provenance = read_provenance(self.root, self.name)
        rows = self.rows()
        if self.mode == "stream":
            step = self.rows_per_record or len(rows)
            samples = []
            for start in range(0, len(rows), step):
                group = rows[start: start + step]
                ids = [tokenizer(text).input_ids for text in group]
                samples.append(Sample(
                    id=f"rows{start}-{start + len(group) - 1}", prompt="".join(group), answers=[],
                    max_new_tokens=0, input_ids=tuple(t for row in ids for t in row),
                    meta={"task": "stream", "row_lengths": [len(r) for r in ids], "first_row": start}))
            return samples
        ids = tokenizer("\n\n".join(rows)).input_ids
        samples = []
        for index, start in enumerate(range(0, len(ids), self.window)):
            window = ids[start: start + self.window]
            if len(window) <= self.context:
                break
            samples.append(Sample(id=f"window{index}", prompt="", answers=[], max_new_tokens=0,
                                  input_ids=tuple(window),
                                  meta={"task": "chunked", "start": start, "context": self.context}))
        logger.info("wikitext_ppl: %d windows of %d tokens (%d context)", len(samples), self.window, self.context)
        return samples

    def rows_of(self, sample: Sample) -> list[list[int]]:
        """A stream record's token ids, row by row."""
        out, at = [], 0
        for n in sample.meta["row_lengths"]:
            out.append(list(sample.input_ids[at: at + n]))
            at += n
        return out

    def score(self, sample: Sample, prediction: str) -> dict[str, float]:  # pragma: no cover - not generated
        raise TypeError("wikitext_ppl is scored by kvbench.engine.perplexity, not from generated text")

    def summarize(self, records: list[dict]) -> dict:
        nll = sum(r["nll_sum"] for r in records)
        n = sum(r["n_tokens"] for r in records)
        return {"perplexity": {"mode": self.mode, "ppl": math.exp(nll / n) if n else None, "nll_sum": nll,
                               "n_tokens": n, "n_records": len(records)}}
