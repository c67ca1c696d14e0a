"""kvbench as an lm-evaluation-harness model: every lm-eval task under any compression method.

    python -m kvbench.harness --model kvbench --model_args model=smollm2,method=h2o,budget=128 --tasks piqa
    python -m kvbench.harness --model kvbench --model_args model=hf,path=<hub id>,method=snapkv,ratio=0.5 ...

`python -m kvbench.harness` is lm-eval's own command line (lm-eval==0.4.13) with the `kvbench` model registered
first. The plain `lm_eval` command cannot see it: lm-eval 0.4.13 looks models up only in its own MODEL_MAPPING or
among classes already imported into the process (no plugin entry points), so in Python do `import kvbench.harness`
before `lm_eval.simple_evaluate(model="kvbench", ...)`.

Model arguments: `model` (a configs/model name, default smollm2), `path` (with model=hf), `method` (a configs/method
name, default full), `budget` or `ratio` (fraction of the context's entries removed, the Keyformer/H2O few-shot
"50 % KV" setting), `positions` (original | shift), `seed`, `add_bos_token`, and `method.<field>=value` for method
knobs (e.g. `method.recent_ratio=0.3`) and for the kvpress-wrapper switches the command's `+method.<key>` sets
(`method.whole_layers=[0]`, `method.layer_ratios=[...]`, `method.chunk_length`, `method.block_size`,
`method.then=knorm` with `method.first_ratio=0.5`, `method.merge=true`: kvbench/methods/wrappers.py). lm-eval's
batch_size/device are accepted and ignored (batch 1, the model config's device).

The run is built through kvbench's API as `python -m kvbench.run` builds it (`RunSpec(...).validate()`, then
`Engine(run)`, kvbench/runs/api.py): configs/method/<name>.yaml with its `${model.*}` fields read from the model config
(TailorKV's published layer split, KVzip's chat template), its values checked by the rules of kvbench/runs/schema.py
and its switches applied by `kvbench.runs.config.build_method` (a bad value fails in one line before the weights
load), then `method.prepare` once after the weights load (TailorKV identifies its split on the
calibration prompt where the model config lists none; learned artefacts load); what it returns is in lm-eval's
results as `config.method_prepared` (manifest.json's field in a run).

Semantics (what is compressed, where the continuation starts):
- loglikelihood(context, continuation): the context tokens (lm-eval's own `_encode_pair` split; an empty context is
  the prefix token) are prefilled with full attention and compressed by the method to the budget; the continuation
  is then teacher-forced one token per forward against the compressed cache (decode-time methods keep evicting),
  its first token scored from the prefill's last logits. The result is (sum of log-probs, all tokens greedy).
- generate_until: the context is prefilled, compressed, and generated from greedily (kvbench.engine.generation),
  stopping at any `until` string or after `max_gen_toks` (default 256).
- loglikelihood_rolling: the whole text after the prefix token is a token-by-token stream (kvbench.engine.perplexity's
  stream): decode-time methods evict during it; prefill-only methods have no prompt to select from and keep all.
Keyformer's and H2O's published few-shot numbers (Keyformer Table 2) came from a different simulation: one forward
over the whole request with the budget taken from its full length and a per-row attention mask (H2O's
`local_heavy_hitter_mask`, copied into d-matrix-ai/keyformer-llm @f327831), not from a compressed context; numbers
are comparable in spirit, not bit for bit.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

logger = logging.getLogger(__name__)
CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def model_fields(name: str, path: str | None) -> dict:
    """configs/model/<name>.yaml as a dict (`path` replacing its path, for model=hf)."""
    from omegaconf import OmegaConf

    from kvbench.runs.config import load_yaml

    file = CONFIG_DIR / "model" / f"{name}.yaml"
    if not file.is_file():
        raise ValueError(f"kvbench: no model config '{name}' in configs/model/")
    fields = OmegaConf.to_container(load_yaml(file), resolve=True)
    if path is not None:
        fields["path"] = path
    return fields


def flow_list(value):
    """A `method.<field>=[0]` model argument as the list it spells: lm-eval's argument string (`create_from_arg_string`,
    `simple_evaluate(model_args="...")`) leaves it text; its command line, which splits only at commas outside
    brackets, already gives `method.whole_layers=[0,1]` as a list."""
    if isinstance(value, str) and value.startswith("[") and value.endswith("]"):
        import yaml

        try:
            return yaml.safe_load(value)
        except yaml.YAMLError:
            return value
    return value


def build_method(name: str, overrides: dict, model: dict | None = None):
    """A method from configs/method/<name>.yaml with `overrides` (its `method.<field>` model arguments) applied, built
    as `python -m kvbench.run` builds it: its `${model.<key>}` interpolations read `model` (the fields of a
    configs/model file: TailorKV's published layer split, KVzip's chat template), the values checked against
    kvbench/runs/schema.py's rules, and the kvpress-wrapper switches (`method.whole_layers`, `layer_ratios`,
    `chunk_length`, `block_size`, `then` + `first_ratio`, `merge`) applied by `kvbench.runs.config.build_method`."""
    from omegaconf import OmegaConf

    from kvbench.runs import config
    from kvbench.runs.schema import check

    try:
        node = OmegaConf.merge(config.method_node(name, model), overrides)
        check(OmegaConf.create({"method": node}))
        return config.build_method(node, model=model)
    except ValueError as e:
        raise ValueError(f"kvbench: {e}") from None


def override_value(value) -> str:
    """A model argument's value as a Hydra override spells it (`[0,1]`, `true`, `null`)."""
    import json

    if value is None or isinstance(value, (bool, list, tuple)):
        return json.dumps(list(value) if isinstance(value, tuple) else value, separators=(",", ":"))
    return str(value)


def run_spec(model: str, path: str | None, method: str, budget, ratio, positions: str, seed: int,
             method_overrides: dict):
    """The run these model arguments stand for, built and checked as `python -m kvbench.run` builds its run
    (kvbench.runs.api): configs/ composed (the method's `${model.*}` fields read from the model config), every value
    checked by kvbench/runs/schema.py's rules, the kvpress-wrapper switches applied. One line on bad input, before the
    weights load."""
    from kvbench.runs.api import RunSpec

    overrides = [f"positions={positions}", f"seed={int(seed)}", *([f"model.path={path}"] if path is not None else []),
                 *(f"++method.{k}={override_value(v)}" for k, v in method_overrides.items())]
    spec = RunSpec(method=method, model=model, budget=None if budget is None else int(budget),
                   ratio=None if ratio is None else float(ratio), overrides=tuple(overrides))
    try:
        return spec.validate()
    except (ValueError, KeyError, FileNotFoundError) as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        raise ValueError(f"kvbench: {message}") from None


@register_model("kvbench")
class KVBenchLM(TemplateLM):
    """See the module docstring. Batch 1; one `AttentionCapture` held for the model's lifetime."""

    def __init__(self, model: str = "smollm2", path: str | None = None, method: str = "full",
                 budget: int | None = None, ratio: float | None = None, positions: str = "original", seed: int = 0,
                 add_bos_token: bool = False, max_gen_toks: int = 256, **kwargs):
        super().__init__()
        from kvbench.runs.api import Engine

        method_overrides = {k.split(".", 1)[1]: flow_list(v) for k, v in kwargs.items() if k.startswith("method.")}
        ignored = sorted(k for k in kwargs if not k.startswith("method.") and kwargs[k] is not None)
        if ignored:
            logger.info("kvbench: ignoring lm-eval arguments %s (batch 1, device from the model config)", ignored)
        if (budget is None) == (ratio is None) and method != "full":
            raise ValueError("kvbench: give exactly one of budget=<entries> or ratio=<fraction removed>")
        if ratio is not None and not 0 <= float(ratio) < 1:
            raise ValueError(f"kvbench: ratio={ratio} must be in [0, 1)")
        if positions not in ("original", "shift"):
            raise ValueError(f"kvbench: positions={positions!r} is not one of original, shift")
        run = run_spec(model, path, method, budget, ratio, positions, seed, method_overrides)
        self.run = run
        self.method = run.method
        self.budget, self.ratio = run.cfg.budget, run.cfg.ratio
        self.positions, self.seed, self.add_bos_token = positions, int(seed), bool(add_bos_token)
        self.max_gen_toks = int(max_gen_toks)
        # Engine loads the weights, then runs `method.prepare` as `python -m kvbench.run` does (before the capture,
        # whose window may depend on it; TailorKV identifies its split on its own prefill) and attaches the capture,
        # held for the model's lifetime
        self.engine = Engine(run)
        self.model, self.tokenizer, self.capture = self.engine.model, self.engine.tokenizer, self.engine.capture
        self.prepared = self.engine.prepared
        if self.prepared is not None:
            logger.info("kvbench: %s prepared: %s", self.method.registry_name, self.prepared)

    def get_model_info(self) -> dict:
        """Added by lm-eval to its results' `config`: what `prepare` found (manifest.json's `method_prepared` in a
        kvbench run), e.g. TailorKV's layer split, and the method's table name where it has one of its own
        (`method_label`: a variant's `tailorkv-1`, a wrapped `snapkv+per_layer`), as a kvbench run's manifest names
        it; kvbench.report.lm_eval_runs copies both into the run directories it writes."""
        label = getattr(self.method, "label", None)
        return {**({} if self.prepared is None else {"method_prepared": self.prepared}),
                **({} if label is None else {"method_label": label})}

    # --- lm-eval's tokenizer hooks ----------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        special = self.add_bos_token if add_special_tokens is None else add_special_tokens
        return self.tokenizer(string, add_special_tokens=special).input_ids

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    # --- scoring ----------------------------------------------------------------------------------------------
    def budget_for(self, n_context: int) -> int | None:
        return self.run.budget_for(n_context)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        from kvbench.engine.perplexity import continuation_logprob

        out = []
        for _, context, continuation in tqdm(requests, disable=disable_tqdm, desc="kvbench loglikelihood"):
            out.append(continuation_logprob(self.model, self.method, self.capture, list(context), list(continuation),
                                            self.budget_for(len(context)), self.positions, self.seed))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from kvbench.engine.perplexity import stream_nll

        out = []
        for (string,) in tqdm([r.args for r in requests], disable=disable_tqdm, desc="kvbench rolling"):
            tokens = [self.prefix_token_id] + self.tok_encode(string, add_special_tokens=False)
            budget = self.budget_for(len(tokens))
            out.append(-stream_nll(self.model, self.method, self.capture, [tokens], budget, self.positions,
                                   self.seed).nll_sum)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from kvbench.engine.batching import generate

        out = []
        device = next(self.model.parameters()).device
        for context, gen_kwargs in tqdm([r.args for r in requests], disable=disable_tqdm, desc="kvbench generate"):
            until = gen_kwargs.get("until", [])
            until = [until] if isinstance(until, str) else list(until)
            ids = self.tok_encode(context)
            gen = generate(self.model, self.tokenizer, self.method, self.capture, torch.tensor([ids], device=device),
                           self.budget_for(len(ids)), int(gen_kwargs.get("max_gen_toks", self.max_gen_toks)),
                           stop=tuple(until), positions=self.positions, seed=self.seed)
            out.append(gen.text)
        return out


def split_model_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(every `--model_args` value in order, the other arguments)."""
    runs, rest, i = [], [], 0
    while i < len(argv):
        if argv[i] == "--model_args" and i + 1 < len(argv):
            runs.append(argv[i + 1])
            i += 2
            continue
        if argv[i].startswith("--model_args="):
            runs.append(argv[i].split("=", 1)[1])
        else:
            rest.append(argv[i])
        i += 1
    return runs, rest


def share_task_index() -> None:
    """lm-eval scans its thousands of task YAMLs for every TaskManager (seconds of CPU); the scan depends on the
    folders only, so the runs of one command share it (each run still builds its own TaskManager and tasks)."""
    from lm_eval.tasks._index import TaskIndex

    if getattr(TaskIndex.build, "kvbench_shared", False):
        return
    build, scans = TaskIndex.build, {}

    def shared(paths, *, resolve_includes=True):
        paths = list(paths)
        key = (tuple(str(p) for p in paths), resolve_includes)
        if key not in scans:
            scans[key] = build(paths, resolve_includes=resolve_includes)
        return dict(scans[key])

    shared.kvbench_shared = True
    TaskIndex.build = staticmethod(shared)


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line with the kvbench model registered (this module's import did it). Each `--model_args`
    given is one lm-eval run, in this process, one after the other (lm-eval itself keeps the last): the methods of a
    table on the same tasks pay the imports and the task scan once (Keyformer Table 2's smoke form, Makefile
    LM_EVAL_keyformer_smoke)."""
    from lm_eval.__main__ import cli_evaluate

    runs, rest = split_model_args(sys.argv[1:] if argv is None else list(argv))
    if len(runs) > 1:
        share_task_index()
    for model_args in runs or [None]:
        sys.argv = ["lm_eval", *rest, *([] if model_args is None else ["--model_args", model_args])]
        cli_evaluate()


if __name__ == "__main__":
    main()
