"""CNN/DailyMail and XSUM summarization, with the protocols of Keyformer and BUZZ (`protocol=`).

Data: a local folder (`dataset.root`) holding `<split>.jsonl` with the Hub datasets' own fields: CNN/DailyMail
(`abisee/cnn_dailymail`) `id`, `article`, `highlights`; XSUM (`EdinburghNLP/xsum`, its parquet export) `id`,
`document`, `summary`. `scripts/download_seed_tasks.py` writes them where the Hub is reachable, with
`provenance.json` (config, revision, the commit read), which goes into the manifest.
CNN/DailyMail versions: Keyformer's downloader loads 3.0.0, BUZZ's `run_bleu_eval.py` 2.0.0. The dataset card calls
1.0.0 and 2.0.0 anonymized, but the Hub's builder (huggingface/datasets `datasets/cnn_dailymail/cnn_dailymail.py`)
made every config from the same non-anonymized stories, joining the highlights with newlines in 2.0.0 and 3.0.0
(spaces in 1.0.0): the card describes the original releases. So 2.0.0 and 3.0.0 hold the same records and both
protocols read one folder; its provenance.json names the config that was downloaded.

Protocols (each pinned to its authors' code; prompts byte for byte):
- `keyformer` (d-matrix-ai/keyformer-llm @ f327831, `summarization/`): the Alpaca/MLPerf template
  `PROMPT_DICT["prompt_input"]` with the downloader's instruction ("Summarize the following news article:" for
  CNN/DM 3.0.0, "Provide one sentence summary of the following news article:" for XSUM); tokenized with default
  special tokens and cut on the right at 1920 tokens (which can cut "### Response:" off a long article); 128 new
  tokens; `n_obs` samples drawn with replacement by `np.random.seed(12345); np.random.randint(len, size=n_obs)`
  (README: 1000); the paper decodes with 4 beams (`generation.num_beams=4`). The code's `min_length=30` bounds the
  total length, a no-op on these prompts, so it is not applied. Left padding to 1920 is not emulated (it only
  inflates the code's percentage budgets: its drivers tokenize with `padding="max_length"`, `max_length=1920`).
  Scores: `rouge1/2/L/Lsum`.
- `buzz` (JunqiZhao888/buzz-llm @ e6f5e3e, `main_run.py`): `"Text: {text}\\n\\nSUMMARIZE the previous text to 50
  words!"`, the first 40 records of the split, greedy, up to 1000 new tokens or EOS. Scores: `buzz_rouge1/2/L`
  (pltrdy `rouge`) and, over a run, BUZZ's geometric "mean ROUGE".
- `buzz_selfbleu` (CNN/DM only, `run_bleu_eval.py`): `"Text: {article}\\nSUMMARIZE the previous text to 150
  words!"` (one newline), as `buzz` otherwise; score `self_bleu` (intra-summary Self-BLEU-3).
Every protocol records both ROUGE families (named apart) so runs can be compared either way.
No chat template (both papers fed plain text); a prompt longer than the model's `max_prompt_tokens` is cut in the
middle (BUZZ's code did not cut; Keyformer's 1920 cut comes first).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Mapping

import numpy as np

from kvbench.data.base import Dataset, Sample
from kvbench.data.jsonl import check_unique, find_file, read_jsonl, read_provenance
from kvbench.metrics.stats import geometric_mean_of_means
from kvbench.metrics.summarization import (
    KEYFORMER_KEYS, buzz_rouge, keyformer_rouge, keyformer_table, mean_rouge, self_bleu,
)
from kvbench.registry import DATASETS, unknown_choice

logger = logging.getLogger(__name__)

KEYFORMER_TEMPLATE = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
)
KEYFORMER_INSTRUCTION = {"cnn_dailymail": "Summarize the following news article:",
                         "xsum": "Provide one sentence summary of the following news article:"}
BUZZ_ROUGE_TEMPLATE = "Text: {text}\n\nSUMMARIZE the previous text to 50 words!"
BUZZ_SELFBLEU_TEMPLATE = "Text: {text}\nSUMMARIZE the previous text to 150 words!"


@dataclass(frozen=True)
class Protocol:
    max_new_tokens: int
    num_samples: int            # default sample count
    primary_metric: str
    max_input_tokens: int | None = None  # right truncation (Keyformer's tokenizer max_length)
    draw_seed: int | None = None         # with-replacement draw (Keyformer); None = first N records


PROTOCOLS = {
    "keyformer": Protocol(max_new_tokens=128, num_samples=1000, primary_metric="rouge2", max_input_tokens=1920,
                          draw_seed=12345),
    "buzz": Protocol(max_new_tokens=1000, num_samples=40, primary_metric="buzz_rouge1"),
    "buzz_selfbleu": Protocol(max_new_tokens=1000, num_samples=40, primary_metric="self_bleu"),
}
SOURCES = {  # dataset -> (text field, reference field, Hub id and config the protocols used)
    "cnn_dailymail": ("article", "highlights", "abisee/cnn_dailymail 3.0.0 (Keyformer) / 2.0.0 (BUZZ; same records)"),
    "xsum": ("document", "summary", "EdinburghNLP/xsum (refs/convert/parquet)"),
}
DOWNLOAD_HINT = ("run `python scripts/download_seed_tasks.py cnn_dailymail xsum` (needs the Hugging Face Hub) "
                 "or set dataset.root")


def draw_with_replacement(n_records: int, n_obs: int, seed: int) -> list[int]:
    """Keyformer's `np.random.seed(seed); np.random.randint(n_records, size=n_obs)` (the legacy global stream)."""
    return np.random.RandomState(seed).randint(n_records, size=n_obs).tolist()


@dataclass
class Summarization(Dataset):
    """One summarization set (`name`: cnn_dailymail | xsum) under one protocol; see the module docstring."""

    name: str = "cnn_dailymail"
    version: str = "1"
    root: str = "data/cnn_dailymail"
    split: str = "validation"
    protocol: str = "buzz"
    num_samples: int | None = None   # None: the protocol's count (Keyformer 1000, BUZZ 40)
    max_new_tokens: int | None = None  # None: the protocol's
    primary_metric: str = ""
    provenance: dict = field(default_factory=dict, init=False, repr=False)  # provenance.json, into the manifest
    # BUZZ Table 2's "mean ROUGE" (x 1, in [0, 1]): scores.json metrics/stats, with a bootstrap se
    corpus_metrics: ClassVar[Mapping] = {
        "buzz_mean_rouge": geometric_mean_of_means("buzz_rouge1", "buzz_rouge2", "buzz_rougeL")}

    def __post_init__(self) -> None:
        if self.name not in SOURCES:
            raise ValueError(f"summarization: name={self.name!r} is not one of {', '.join(SOURCES)}")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"{self.name}: " + unknown_choice("protocol", self.protocol, list(PROTOCOLS)))
        if self.protocol == "buzz_selfbleu" and self.name != "cnn_dailymail":
            raise ValueError(f"{self.name}: protocol buzz_selfbleu is BUZZ's CNN/DailyMail driver; use "
                             "dataset=cnn_dailymail, or protocol buzz | keyformer.")
        if self.num_samples is not None and self.num_samples < 1:
            raise ValueError(f"{self.name}: num_samples={self.num_samples} must be >= 1 or null.")
        self.primary_metric = PROTOCOLS[self.protocol].primary_metric

    @property
    def path(self) -> Path | None:
        return find_file(self.root, self.split)

    def check(self) -> None:
        """One-line FileNotFoundError before weights load if the split file is missing."""
        if self.path is None:
            raise FileNotFoundError(f"{self.name}: no {self.split}.jsonl in {Path(self.root).expanduser()}/; "
                                    f"{DOWNLOAD_HINT}=<folder with {self.split}.jsonl>.")

    def records(self) -> list[tuple[str, dict]]:
        """(sample id, record) in run order: the first N records, or Keyformer's seeded draw (ids carry the draw
        index, since a record can be drawn twice)."""
        text_key, ref_key, _ = SOURCES[self.name]
        records = read_jsonl(self.path, {"id": str, text_key: str, ref_key: str}, self.name)
        check_unique(records, "id", self.path, self.name)
        protocol = PROTOCOLS[self.protocol]
        n = self.num_samples or protocol.num_samples
        if protocol.draw_seed is None:
            return [(r["id"], r) for r in records[:n]]
        draws = draw_with_replacement(len(records), n, protocol.draw_seed)
        return [(f"{k:04d}-{records[i]['id']}", records[i]) for k, i in enumerate(draws)]

    def prompt(self, text: str) -> str:
        if self.protocol == "keyformer":
            return KEYFORMER_TEMPLATE.format_map({"instruction": KEYFORMER_INSTRUCTION[self.name], "input": text})
        template = BUZZ_SELFBLEU_TEMPLATE if self.protocol == "buzz_selfbleu" else BUZZ_ROUGE_TEMPLATE
        return template.format(text=text)

    def build(self, tokenizer, max_prompt_tokens: int | None = None, chat_template: bool = False) -> list[Sample]:
        self.check()
        self.provenance = read_provenance(self.root, self.name)
        protocol = PROTOCOLS[self.protocol]
        text_key, ref_key, _ = SOURCES[self.name]
        samples, n_cut = [], 0
        for index, (sample_id, record) in enumerate(self.records()):
            prompt = self.prompt(record[text_key])
            ids = tokenizer(prompt).input_ids
            if protocol.max_input_tokens is not None and len(ids) > protocol.max_input_tokens:
                ids = ids[: protocol.max_input_tokens]  # tokenizer(truncation=True, max_length=1920), right side
            if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
                half = max_prompt_tokens // 2
                ids, n_cut = ids[:half] + ids[-half:], n_cut + 1
            samples.append(Sample(id=sample_id, prompt=prompt, answers=[record[ref_key]],
                                  max_new_tokens=self.max_new_tokens or protocol.max_new_tokens,
                                  meta={"task": self.name, "index": index, "protocol": self.protocol},
                                  input_ids=tuple(ids)))
        logger.info("%s: %d samples (protocol %s, %d middle-truncated to %s tokens)", self.name, len(samples),
                    self.protocol, n_cut, max_prompt_tokens)
        return samples

    def score(self, sample: Sample, prediction: str) -> dict[str, float]:
        reference = sample.answers[0]
        scores = {**keyformer_rouge(prediction, reference),
                  **{f"buzz_{k}": v for k, v in buzz_rouge(prediction, reference).items()}}
        if self.protocol == "buzz_selfbleu":
            scores["self_bleu"] = self_bleu(prediction)
        return scores

    def summarize(self, records: list[dict]) -> dict:
        """The papers' numbers over the finished records: Keyformer's rouge table (x100, 4 decimals), BUZZ's
        R-1/R-2/R-L (x100) with their geometric mean, and the mean Self-BLEU (x100) where scored."""
        if not records:
            return {}
        per_sample = [r["scores"] for r in records]
        buzz = {k: 100 * float(np.mean([s[f"buzz_{k}"] for s in per_sample])) for k in ("rouge1", "rouge2", "rougeL")}
        out = {"protocol": self.protocol, "n": len(records),
               "keyformer_rouge": keyformer_table([{k: s[k] for k in KEYFORMER_KEYS} for s in per_sample]),
               "buzz_rouge": {**buzz, "mean_rouge": mean_rouge(buzz["rouge1"], buzz["rouge2"], buzz["rougeL"])}}
        if all("self_bleu" in s for s in per_sample):
            out["self_bleu"] = 100 * float(np.mean([s["self_bleu"] for s in per_sample]))
        return {"summarization": out}


@DATASETS.register("cnn_dailymail")
@dataclass
class CnnDailymail(Summarization):
    name: str = "cnn_dailymail"
    root: str = "data/cnn_dailymail"


@DATASETS.register("xsum")
@dataclass
class Xsum(Summarization):
    name: str = "xsum"
    root: str = "data/xsum"
