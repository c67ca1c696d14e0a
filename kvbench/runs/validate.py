"""Check a whole command line before Hydra creates a run directory and before any weights load.

`python -m kvbench.run ...` calls `validate_or_exit(argv)` first. It parses the overrides with Hydra's own parser,
expands a `-m` sweep into its jobs exactly as Hydra's basic sweeper will (the sweeper's `params` from the config,
then the command line), composes each job's config with Hydra's compose API (~0.1 s a job), and runs the same
`setup(cfg)` the job will run, plus the checks that need files but no weights: the model's files
(kvbench/models/checks.py), datasets' `check_fits(tokenizer)` (RULER lengths), the run directory (inside
`results_dir`, writable). Each value's rule is judged first, for every job, from kvbench/runs/rules.json
(`check_values`): before torch and transformers are imported. Any problem ends the command with ONE line
`kvbench: ...` and nothing written: no run directory, no `.hydra/`, no `run.log`. Flags other than `-m` (`--help`,
`--cfg`, `-cn`, ...) go to Hydra unchecked.

Like the launcher plugins under hydra_plugins/, this module is an exception to "only kvbench.run imports Hydra":
it drives Hydra's compose API on kvbench.run's behalf.
"""
from __future__ import annotations

import contextlib
import difflib
import json
import logging
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Iterator

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from kvbench.pathnames import check_inside
from kvbench.registry import unknown_choice

MULTIRUN_FLAGS = ("-m", "--multirun")
RUN_FILES = ("predictions.jsonl", "manifest.json", "scores.json", "config.yaml", "run.log", ".lock", ".hydra",
             ".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml")  # what Hydra rewrites at each start


class BadInput(ValueError):
    """A command-line problem, worded for the user (one line)."""


# --- the command line -> jobs ---------------------------------------------------------------------------------
def split_argv(argv: list[str]) -> tuple[bool, list[str]] | None:
    """(multirun, overrides), or None when a flag other than -m asks Hydra for something else (help, --cfg...)."""
    flags = [a for a in argv if a.startswith("-")]
    if any(f not in MULTIRUN_FLAGS for f in flags):
        return None
    return bool(flags), [a for a in argv if a not in MULTIRUN_FLAGS]


def parse(overrides: list[str]) -> list:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    parsed = []
    for text in overrides:  # one at a time, so the message names the argument
        try:
            parsed += parser.parse_overrides([text])
        except HydraException as e:
            raise BadInput(f"cannot parse the override {text!r}: {first_line(e)} "
                           "(grammar: https://hydra.cc/docs/advanced/override_grammar/basic)") from None
    return parsed


def expand(parsed: list, overrides: list[str], multirun: bool) -> list[list[str]]:
    """Each job's override list: the command line itself, or the product of a sweep as BasicSweeper forms it."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    sweeps = [o for o in parsed if o.is_sweep_override()]
    if not multirun:
        if sweeps:
            o = sweeps[0]
            raise BadInput(f"{o.input_line} gives several values: add -m to run one job per value, or write "
                           f"{o.get_key_element()}=[...] for a list")
        return [overrides]
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    base = compose_job(fixed, hydra=True)
    sweeper = base.hydra.sweeper
    if not str(sweeper.get("_target_", "")).endswith("BasicSweeper"):
        return [fixed]  # another sweeper (optuna, ...) picks values itself: check what is fixed
    params = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items()]
    try:
        jobs = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(params + overrides), None)[0]
    except Exception as e:  # e.g. a range sweep, which the basic sweeper rejects too
        raise BadInput(f"cannot expand the sweep: {first_line(e)}") from None
    return [list(job) for job in jobs]


# --- composing one job ----------------------------------------------------------------------------------------
def compose_job(overrides: list[str], hydra: bool = True) -> DictConfig:
    """Hydra's composition of one job, its multi-line errors turned into one line."""
    import yaml
    from hydra import compose
    from hydra.errors import HydraException, MissingConfigException

    from kvbench.runs.config import yaml_message

    try:
        return compose("config", overrides=overrides, return_hydra_config=hydra)
    except MissingConfigException as e:
        raise BadInput(missing_option_message(e)) from None
    except (HydraException, OmegaConfBaseException) as e:
        raise BadInput(composition_message(e, overrides)) from None
    except yaml.YAMLError as e:  # a config file with broken syntax (a hand-edited config.yaml, a user's own option)
        raise BadInput(yaml_message(e)) from None


def missing_option_message(e: Exception) -> str:
    text = str(e)
    found = re.search(r"Could not find '(.+)/([^/']+)'", text)
    options = re.findall(r"^\t(\S+)$", text, flags=re.MULTILINE)
    if found and options:
        return unknown_choice(found.group(1), found.group(2), options)
    return first_line(e)


def composition_message(e: Exception, overrides: list[str]) -> str:
    text = str(e)
    unknown = re.search(r"Could not override '([^']+)'", text)
    if unknown:
        return unknown_key_message(unknown.group(1), overrides)
    if "Ambiguous value for argument" in text:
        return f"{first_line(e).removeprefix('Ambiguous value for argument ')} gives several values: add -m to sweep"
    cause = e.__cause__
    return first_line(e) + (f" ({first_line(cause)})" if cause is not None else "")


def unknown_key_message(key: str, overrides: list[str]) -> str:
    """"method snapkv has no field 'windw'. Did you mean: window? Fields: ..." (any config node alike)."""
    others = [o for o in overrides if o.lstrip("+~").partition("=")[0] != key]
    parent, _, leaf = key.rpartition(".")
    try:
        cfg = compose_job(others, hydra=True)
    except BadInput:
        return f"unknown config key '{key}'"
    node = OmegaConf.select(cfg, parent) if parent else cfg
    if not isinstance(node, DictConfig):
        return f"unknown config key '{key}': {parent} is not a group of keys"
    keys = sorted(k for k in node if k not in ("_target_", "hydra"))
    close = difflib.get_close_matches(leaf, keys, n=1)
    hint = f" Did you mean: {close[0]}?" if close else ""
    if parent in ("method", "dataset", "model"):
        return (f"{parent} {cfg.hydra.runtime.choices.get(parent)} has no field '{leaf}'.{hint} "
                f"Fields: {', '.join(keys)}")
    where = f"{parent} has no key" if parent else "Unknown config key"
    return f"{where} '{leaf}'.{hint} Valid keys: {', '.join(keys)}" + ("" if parent else " (+key=value adds one)")


# --- checks on a composed job ---------------------------------------------------------------------------------
class Checker:
    """Runs kvbench.runs.config.setup and the file checks on each job, once per distinct model / dataset."""

    def __init__(self, multirun: bool):
        from kvbench.runs.config import setup

        self.setup, self.multirun = setup, multirun
        self.fits_checked: set[str] = set()
        self.servers_probed: set[tuple[str, str]] = set()

    def check(self, cfg: DictConfig, overrides: list[str]) -> None:
        from hydra.core.hydra_config import HydraConfig

        HydraConfig.instance().set_config(cfg)  # the run-dir pattern reads hydra:runtime.choices
        try:
            _, dataset, spec = self.setup(cfg)
            if hasattr(spec, "base_url"):  # model=openai: its tokenizer is local, its server must answer now
                spec = self.check_server(spec)
            if hasattr(dataset, "check_fits"):
                self.check_fits(dataset, spec, cfg.dataset)
            check_run_dir(cfg, overrides, self.multirun)
        except BadInput:
            raise
        except (ValueError, KeyError, FileNotFoundError, TypeError, OmegaConfBaseException) as e:
            raise BadInput(message(e)) from e

    def check_server(self, spec):
        """An unreachable server, or one that does not serve the model, is one line before Hydra writes anything
        (each server asked once); returns the tokenizer's source as a model spec, for `check_fits`."""
        from kvbench.remote.client import probe
        from kvbench.remote.spec import tokenizer_model

        key = (spec.base_url, spec.model_name)
        if key not in self.servers_probed:
            probe(spec.base_url, spec.model_name, spec.api_key_env)
            self.servers_probed.add(key)
        return tokenizer_model(spec)

    def check_fits(self, dataset, spec, node: DictConfig) -> None:
        """Datasets whose samples can be too long for their length setting (RULER) try them with the tokenizer."""
        from kvbench.models.checks import tokenizer_source

        source = tokenizer_source(spec)
        key = json.dumps([OmegaConf.to_container(node, resolve=True), source], sort_keys=True, default=str)
        if source is None or key in self.fits_checked:
            return
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(source, revision=spec.revision)
        except Exception:  # noqa: BLE001 - the run's load() reports a broken tokenizer; nothing to check here
            return
        dataset.check_fits(tokenizer)
        self.fits_checked.add(key)


def check_values(cfg: DictConfig, overrides: list[str]) -> None:
    """What needs no config class imported: each value's rule as rules.json has it (kvbench/runs/rules.py), budget
    with ratio, the shard. A bad value is refused in about the time of a bad name (issue 42)."""
    from kvbench.runs.rules import check_early
    from kvbench.runs.shard import Shard

    check_budget_and_ratio(overrides)
    try:
        check_early(cfg)
        Shard.parse(cfg.get("shard"))
    except (ValueError, OmegaConfBaseException) as e:
        raise BadInput(message(e)) from e


def check_budget_and_ratio(overrides: list[str]) -> None:
    given = dict(o.lstrip("+").partition("=")[::2] for o in overrides)
    if "budget" in given and given.get("ratio", "null") != "null":
        raise BadInput(f"budget={given['budget']} and ratio={given['ratio']} both given; ratio sets each sample's "
                       "budget from its prompt length, so give one of them")


def run_dir_of(cfg: DictConfig, multirun: bool) -> Path:
    """The folder Hydra will create for this job (needs HydraConfig set to `cfg`)."""
    hydra = cfg.hydra
    return Path(hydra.sweep.dir) / hydra.sweep.subdir if multirun else Path(hydra.run.dir)


def check_run_dir(cfg: DictConfig, overrides: list[str], multirun: bool) -> None:
    """The run directory stays inside results_dir (unless hydra.run/sweep.dir is set by hand) and can be written."""
    run_dir = run_dir_of(cfg, multirun)
    if not any(o.lstrip("+").startswith(("hydra.run.", "hydra.sweep.")) for o in overrides):
        check_inside(run_dir, Path(cfg.results_dir), f"the run directory (results_dir={cfg.results_dir})")
    if run_dir.exists():
        for path in [run_dir, *(run_dir / name for name in RUN_FILES)]:
            if path.exists() and not os.access(path, os.W_OK | (os.X_OK if path.is_dir() else 0)):
                raise BadInput(f"{path} is read-only; make it writable (chmod u+w) or set results_dir elsewhere")
        check_run_dir_state(run_dir, cfg.get("shard"))
        return
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise BadInput(f"results_dir={cfg.results_dir}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise BadInput(f"results_dir={cfg.results_dir} cannot be written ({existing} is read-only); set results_dir "
                       "to a writable folder")


def check_run_dir_state(run_dir: Path, shard_text: str | None) -> None:
    """What an existing run directory says before Hydra rewrites its .hydra/ and weights load: no link out of it,
    nobody running in it (the lock is only looked at; the run takes it), a readable manifest, and shards of the same
    split as this one's."""
    from kvbench.runs.merge import MergeError, shard_count
    from kvbench.runs.shard import Shard
    from kvbench.runs.store import RunDirError, check_no_escape, is_held, lock_name, read_json

    shard = Shard.parse(shard_text)
    try:
        check_no_escape(run_dir)
        holder = is_held(run_dir / lock_name(shard))
        if holder is not None:
            what = f"{run_dir} ({shard.tag})" if shard is not None else str(run_dir)
            raise BadInput(f"{what} is in use by {holder}; wait for it to finish or stop it, then rerun")
        read_json(run_dir / (shard.manifest_name if shard is not None else "manifest.json"))
        count = shard_count(run_dir)
    except (RunDirError, MergeError) as e:
        raise BadInput(str(e).removeprefix("store: ")) from None
    if shard is not None and count is not None and count != shard.count:
        raise BadInput(f"shard={shard.index}/{shard.count}: {run_dir} already holds shards of {count} "
                       f"(predictions.shard-*-of-{count}.jsonl); use shard=i/{count}, or move those files away")


# --- entry points ---------------------------------------------------------------------------------------------
def validate(argv: list[str], config_dir: Path | None = None) -> int:
    """Raise BadInput (one line) on the first problem in any job of this command line; return the number of jobs
    checked (0 when the command is not a run, e.g. --help). `config_dir`: another configs/ folder (tests)."""
    from hydra import initialize_config_dir

    from kvbench.runs.config import CONFIG_DIR

    split = split_argv(argv)
    if split is None:
        return 0
    multirun, overrides = split
    parsed = parse(overrides)
    config_dir = str(config_dir or CONFIG_DIR)
    with quiet(), initialize_config_dir(config_dir=config_dir, version_base="1.3", job_name="kvbench"):
        jobs = [(compose_job(job), job) for job in expand(parsed, overrides, multirun)]
        for cfg, job in jobs:  # every value, before torch and transformers are imported (rules.json)
            check_values(cfg, job)
        checker = Checker(multirun)
        for cfg, job in jobs:
            checker.check(cfg, job)
    return len(jobs)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """No warnings while checking: the run itself logs them, and a rejected command prints one line only."""
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(logging.NOTSET)


def validate_or_exit(argv: list[str]) -> None:
    """`validate`, ending the process with one line on a problem. KVBENCH_SKIP_CHECKS=1 skips it: for a cluster
    sweep whose model or data paths exist only on the compute nodes (each job still runs `setup` there)."""
    if os.environ.get("KVBENCH_SKIP_CHECKS") == "1":
        return
    try:
        validate(argv)
    except BadInput as e:
        sys.exit(f"kvbench: {e}")


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def message(e: BaseException) -> str:
    return e.args[0] if isinstance(e, KeyError) and e.args else first_line(e)
