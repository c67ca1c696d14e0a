"""The requests of a run's samples and the records of their replies, for samples asked once or twice.

A dataset may ask each sample a second question whose text depends on the first reply (`Dataset.asks_follow_up`,
`Dataset.follow_up`: LongBench v2's CoT, THUDM pred.py's `0shot_cot_ans.txt`). Both go through the engine's batched
step: once the first reply is done, its request's `then` (`kvbench.engine.batching.Request.then`) gives the second
question as a new request of its own, admitted before any new sample. pred.py's second call is an independent
request to the same server, so it is prefilled and compressed like any prompt: the run's method, with `budget` (or
`ratio`, of that prompt) applied to it, its question (the dataset's split: `Sample.context_tokens`) fed after
compression under `query=agnostic`, greedy or sampled as `generation` says. The two replies make one record,
written when the second is done (`records.followed_record`): a run stopped between them asks both again on resume,
since nothing half-done is written. A failure in either stage gives the sample its failure record.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

from kvbench.data.base import Sample
from kvbench.engine.batching import Request
from kvbench.engine.generation import Generation
from kvbench.runs.config import sample_budget, sample_seed
from kvbench.runs.records import followed_record, generated_record, sample_record


@dataclass(eq=False)
class Job:
    """One sample to run: its ids, budget and agnostic question length, and, once asked, its first reply's record and
    the second question (or why that question could not be asked)."""

    sample: Sample
    ids: list[int]
    budget: int | None
    question_len: int = 0
    first: dict | None = None
    follow: Sample | None = None
    follow_ids: list[int] = field(default_factory=list)
    error: Exception | None = None


class Asking:
    """Requests for a run's jobs (`request`) and one record per sample from what the engine yields (`record`)."""

    def __init__(self, dataset, tokenizer, spec, cfg, method, device):
        self.dataset, self.tokenizer, self.spec, self.cfg, self.method = dataset, tokenizer, spec, cfg, method
        self.device, self.query = device, cfg.get("query", "aware")
        self.follows = getattr(dataset, "asks_follow_up", False)

    def request(self, sample: Sample, ids: list[int], budget: int | None, question_len: int = 0) -> Request:
        job = Job(sample, list(ids), budget, question_len)
        return Request.from_sample(sample, job.ids, budget, sample_seed(self.cfg, sample), self.device,
                                   tag=(job, 0), question_len=question_len,
                                   then=partial(self._second, job) if self.follows else None)

    def _second(self, job: Job, first: Generation) -> Request | None:
        """The second question's request after the first reply (None, with `job.error`, if it cannot be asked).
        Never raises: the engine calls it inside its loop."""
        try:
            job.first = sample_record(self.dataset, job.sample, job.ids, job.budget, first, self.query,
                                      job.question_len)
            job.follow = self.dataset.follow_up(job.sample, first.text, self.tokenizer, self.spec.max_prompt_tokens,
                                                self.spec.chat_template)
            job.follow_ids = list(job.follow.input_ids)
            agnostic = self.query == "agnostic"  # (as run.guarded_sample splits a first prompt)
            n_context = job.follow.context_tokens if agnostic or self.method.window_is_question else None
            question_len = len(job.follow_ids) - n_context if n_context else 0
            budget = sample_budget(self.cfg, len(job.follow_ids) - (question_len if agnostic else 0))
            if self.cfg.ratio is not None:
                try:
                    self.method.check_budget(budget)
                except ValueError as e:
                    raise ValueError(f"ratio={self.cfg.ratio} on the {len(job.follow_ids)}-token second question "
                                     f"gives {e}") from None
        except Exception as e:  # noqa: BLE001 - this sample's failure, recorded when its first request is
            job.error = e
            return None
        return Request.from_sample(job.follow, job.follow_ids, budget, sample_seed(self.cfg, job.sample),
                                   self.device, tag=(job, 1), question_len=question_len)

    def record(self, request: Request, outcome: Generation | Exception) -> dict | None:
        """The sample's record once it is complete; None for a first reply whose second question is on its way."""
        job, stage = request.tag
        if stage == 1:
            return followed_record(self.dataset, job.sample, job.first, job.follow, job.follow_ids, request.budget,
                                   outcome, self.query, request.question_len)
        if self.follows and isinstance(outcome, Generation) and job.error is None:
            return None
        return generated_record(self.dataset, job.sample, job.ids, job.budget, job.error or outcome, self.query,
                                job.question_len)
