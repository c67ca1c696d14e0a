"""kvbench's Python API: a run spec parsed and validated once, and an engine to hand prompts or token ids to.

    from kvbench import Engine, RunSpec

    run = RunSpec(method="snapkv", budget=128, batch_size=2).validate()  # every check, before weights load
    with Engine(run) as engine:
        outs = engine.generate(["The pass key is 71432. ...", "..."], max_new_tokens=16)
    outs[0].text, outs[0].kv_bytes, outs[0].full_kv_bytes

`RunSpec` composes configs/ as the command line does (Hydra's compose API; any other key as an override string),
and `validate()` runs `runs.config.setup`, the checks every door shares, into a `Run`: the built method, dataset,
model spec, sampling and decoding. `Run.from_config` does the same for a config Hydra already composed
(`python -m kvbench.run`). `Engine` loads the model once and generates through the engine's continuous batching
(kvbench.engine.batching); `requests`/`decoder` hand the same pieces to a caller that schedules on its own (the load
benchmark, kvbench.serving)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from kvbench.runs.config import CONFIG_DIR, GROUPS, decode_compression, group_choices, sample_budget, sample_seed


@dataclass(frozen=True)
class RunSpec:
    """What a run is, by the names the command line uses: `RunSpec(method="snapkv", budget=128)` is
    `python -m kvbench.run method=snapkv budget=128`. `overrides` takes any other `key=value` as written there
    (`"model.path=..."`, `"method.window=8"`, `"dataset.context_lengths=[1000]"`)."""

    method: str = "full"
    budget: int | None = 128  # KV entries kept per KV head per layer, averaged (window included)
    ratio: float | None = None  # instead of budget: the fraction of prompt entries removed
    model: str = "smollm2"  # a configs/model option (model="hf" with overrides=("model.path=...",))
    dataset: str = "niah"
    batch_size: int = 1  # requests decoded together (continuous batching)
    generation: Mapping[str, Any] = field(default_factory=dict)  # do_sample, temperature, top_k, top_p, num_beams
    overrides: tuple[str, ...] = ()

    def as_overrides(self) -> list[str]:
        """The command line this spec stands for (after `python -m kvbench.run`)."""
        def value(v) -> str:
            return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)

        args = [f"model={self.model}", f"method={self.method}", f"dataset={self.dataset}",
                f"budget={value(self.budget)}", f"ratio={value(self.ratio)}", f"batch_size={self.batch_size}"]
        args += [f"generation.{k}={value(v)}" for k, v in self.generation.items()]
        return args + list(self.overrides)

    def validate(self) -> Run:
        """The composed, checked run; a ValueError of one line (naming the valid choices) on bad input, before any
        weights load and without writing anything."""
        from kvbench.registry import unknown_choice

        for group in GROUPS:
            name = getattr(self, group)
            if name not in (choices := group_choices(group)):
                raise ValueError(unknown_choice(group, name, choices))
        cfg, choices = compose(self.as_overrides())
        return Run.from_config(cfg, choices)


def compose(overrides: list[str]) -> tuple[DictConfig, dict[str, str]]:
    """configs/config.yaml with `overrides`, as Hydra composes a job, without its `hydra` node; and the group
    options picked. Composition errors come back as one-line ValueErrors (kvbench.runs.validate's wording)."""
    from hydra import initialize_config_dir

    from kvbench.runs.validate import compose_job, quiet

    with quiet(), initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3", job_name="kvbench"):
        cfg = compose_job(overrides, hydra=True)
    choices = {g: cfg.hydra.runtime.choices[g] for g in GROUPS}
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg, choices


@dataclass(eq=False)
class Run:
    """A validated run: the config (what records and run directories are named from) and what `setup` built from
    it. Nothing here has loaded weights."""

    cfg: DictConfig
    method: Any  # kvbench.methods.base.Method
    dataset: Any  # kvbench.data.base.Dataset
    model: Any  # kvbench.models.loader.ModelSpec
    choices: dict[str, str]  # the group options picked: names used in paths and manifests

    @classmethod
    def from_config(cls, cfg: DictConfig, choices: dict[str, str] | None = None) -> Run:
        """`runs.config.setup(cfg)`'s checks and objects (ValueError, KeyError or FileNotFoundError on bad input)."""
        from kvbench.runs.config import setup

        method, dataset, spec = setup(cfg)
        return cls(cfg, method, dataset, spec, dict(choices or {}))

    @property
    def job(self) -> tuple:
        """(method, dataset, model spec): what `runs.run.run` takes as an already validated job."""
        return self.method, self.dataset, self.model

    @property
    def remote(self) -> bool:
        """A run against an OpenAI-compatible server (`model=openai`, kvbench.remote): no weights load here;
        `open_engine` gives its `RemoteEngine`."""
        return hasattr(self.model, "base_url")

    @property
    def batch_size(self) -> int:
        return int(self.cfg.batch_size)

    def sampling(self):
        from kvbench.engine.generation import Sampling

        return Sampling(**OmegaConf.to_container(self.cfg.generation, resolve=True), seed=self.cfg.seed)

    def decoding(self):
        """How every request of this run decodes (method, sampling, positions, compression while decoding)."""
        from kvbench.engine.batching import Decoding

        return Decoding(self.method, self.sampling(), self.cfg.positions, self.cfg.get("compress_after", "layer"),
                        decode_compression(self.cfg))

    def budget_for(self, prompt_len: int) -> int | None:
        """The budget a prompt of `prompt_len` tokens runs with (`ratio` gives one per prompt)."""
        return sample_budget(self.cfg, prompt_len)


class Engine:
    """A run's model, loaded once, with its method's capture attached: hand it prompts (text, rendered as the run's
    model config says) or token ids, get `Generation`s back (text, token ids, KV bytes before and after compression
    and at the end of decoding, timings). Close it (or use `with`) to remove the capture from the model."""

    def __init__(self, run: Run | RunSpec, loaded: tuple | None = None):
        """`loaded`: (model, tokenizer) of an engine closed before, for the same model spec (a sweep loads once)."""
        from kvbench.engine.generation import prefill
        from kvbench.models import AttentionCapture, load

        self.run = run.validate() if isinstance(run, RunSpec) else run
        if self.run.remote:
            raise ValueError("Engine: model=openai generates on a server; use kvbench.runs.api.open_engine(run) "
                             "(a RemoteEngine)")
        self.model, self.tokenizer = loaded or load(self.run.model)
        self.prepared = self.run.method.prepare(self.model, self.tokenizer, prefill=prefill)
        self._capture = AttentionCapture(self.model, window=self.run.method.query_window)
        self.capture = self._capture.__enter__()
        self.device = next(self.model.parameters()).device

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.capture is not None:
            self._capture.__exit__(None, None, None)
            self.capture = None

    # --- prompts and requests ---------------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids as the model reads the prompt (chat template per the model config); ids pass through."""
        from kvbench.runs.prompts import encode

        return list(prompt) if not isinstance(prompt, str) else encode(self.tokenizer, prompt, self.run.model)

    def request(self, prompt: str | Sequence[int], max_new_tokens: int = 64, stop: Sequence[str] = (),
                tag: object = None, seed: int = 0):
        """One prompt as a request of the engine's step, at the run's budget for its length."""
        import torch

        from kvbench.engine.batching import Request

        ids = self.encode(prompt)
        return Request(torch.tensor([ids], device=self.device), self.run.budget_for(len(ids)), max_new_tokens,
                       tuple(stop), seed=seed, tag=tag)

    def sample_request(self, sample):
        """A dataset sample as a request (its prompt ids, budget, stop rule, lengths and seed, as the command line
        runs it; question-aware), tagged `(sample, ids)` for `record`."""
        from kvbench.engine.batching import Request
        from kvbench.runs.prompts import prompt_ids

        ids = prompt_ids(sample, self.tokenizer, self.run.model)
        return Request.from_sample(sample, ids, self.run.budget_for(len(ids)), sample_seed(self.run.cfg, sample),
                                   self.device)

    def samples(self, limit: int | None = None) -> list:
        """The run's dataset, built for this model's tokenizer (the first `limit` samples)."""
        spec = self.run.model
        samples = self.run.dataset.build(self.tokenizer, spec.max_prompt_tokens, chat_template=spec.chat_template)
        return samples[:limit] if limit is not None else samples

    def record(self, request, outcome) -> dict:
        """The prediction record (or failure record) of a finished `sample_request`, as predictions.jsonl holds it."""
        from kvbench.runs.records import generated_record

        sample, ids = request.tag
        return generated_record(self.run.dataset, sample, ids, request.budget, outcome)

    # --- generating ---------------------------------------------------------------------------------------------
    def decoder(self, batch_size: int | None = None):
        """The engine's continuous-batching decoder for this run (`run(requests)` yields each as it finishes)."""
        from kvbench.engine.batching import BatchedDecoder

        d = self.run.decoding()
        return BatchedDecoder(self.model, self.tokenizer, d.method, self.capture, batch_size or self.run.batch_size,
                              d.sampling, d.positions, compress_after=d.compress_after, recompress=d.recompress)

    def generate(self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int = 64, stop: Sequence[str] = (),
                 batch_size: int | None = None) -> list:
        """Generations for `prompts`, in their order, decoded `batch_size` (default: the run's) at a time. A prompt
        that fails raises its exception, after the others finished."""
        requests = [self.request(p, max_new_tokens, stop, tag=i) for i, p in enumerate(prompts)]
        outcomes = {request.tag: outcome for request, outcome in self.decoder(batch_size).run(requests)}
        for i in range(len(requests)):
            if isinstance(outcomes[i], Exception):
                raise outcomes[i]
        return [outcomes[i] for i in range(len(requests))]


def open_engine(run: Run | RunSpec):
    """The engine of `run`: an `Engine` (the model loaded here), or for `model=openai` a
    `kvbench.runs.remote.RemoteEngine` (requests to the server; the same samples, prompts and records)."""
    run = run.validate() if isinstance(run, RunSpec) else run
    if run.remote:
        from kvbench.runs.remote import RemoteEngine

        return RemoteEngine(run)
    return Engine(run)
