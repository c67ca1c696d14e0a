"""The README's tour (issue 42: its "5-minute" examples ran the 20-sample NIAH grid and 55 RULER samples at 4k, over
an hour each on 2 CPU cores): every `python -m kvbench.run` line not marked `# GPU` passes the checks a run makes
before loading weights, and is sized for the embedded model on a CPU: at most 16 samples over all its jobs, none
longer than 2048 tokens (about a minute per sample on 2 loaded cores, measured)."""
from __future__ import annotations

import math
import re
import shlex

import pytest
from hydra import compose, initialize_config_dir

from kvbench.runs.config import CONFIG_DIR
from kvbench.runs.validate import validate
from tests.unit.test_cli import ROOT

MAX_SAMPLES, MAX_TOKENS = 16, 2048


def tour_commands() -> list[tuple[list[str], str]]:
    """(arguments, comment) of each kvbench.run line in the tour's code blocks."""
    text = (ROOT / "README.md").read_text()
    tour = text[text.index("## A tour in minutes"):text.index("**3. Report.**")]
    found = []
    for line in re.findall(r"^python -m kvbench\.run .*$", tour, flags=re.MULTILINE):
        command, _, comment = line.partition("#")
        found.append((shlex.split(command)[3:], comment))
    return found


def first_job(args: list[str]) -> tuple[list[str], int]:
    """A sweep's first job (each comma list's first value; lists in brackets are values) and its number of jobs."""
    jobs, first = 1, []
    for arg in args:
        key, _, value = arg.partition("=")
        if "," in value and not value.startswith("["):
            jobs *= len(value.split(","))
            arg = f"{key}={value.split(',')[0]}"
        if arg != "-m":
            first.append(arg)
    return first, jobs


def size(args: list[str]) -> tuple[int, int]:
    """(samples over all jobs, longest prompt in tokens) from the composed config of the first job."""
    first, jobs = first_job(args)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[a for a in first if not a.startswith("hydra/")])
    data = cfg.dataset
    if data._target_.endswith("NeedleHaystack"):
        samples, tokens = len(data.context_lengths) * len(data.depth_percents), max(data.context_lengths)
    elif data._target_.endswith("Ruler"):
        lengths = data.lengths or [data.length]
        samples, tokens = len(data.tasks) * data.num_samples * len(lengths), max(lengths)
    else:
        pytest.fail(f"{args}: size this dataset here")
    return jobs * min(samples, cfg.limit or samples), tokens


def test_the_tour_marks_gpu_commands_and_sizes_the_rest():
    commands = tour_commands()
    assert len(commands) >= 4 and any("GPU" in comment for _, comment in commands)
    for args, comment in commands:
        if "GPU" in comment:
            continue
        samples, tokens = size(args)
        assert samples <= MAX_SAMPLES and tokens <= MAX_TOKENS, (args, samples, tokens)


def test_the_full_grid_is_what_the_size_rule_refuses():
    assert size(["method=snapkv"]) == (20, 4000)  # the default NIAH grid: not a tour command
    assert size(["dataset=ruler"])[0] == 65  # 13 tasks x 5 at 4k


def test_each_cpu_command_passes_the_checks(tmp_path):
    """A sweep's first job stands for it (its other jobs differ in method and budget, which test_validate checks)."""
    for args, comment in tour_commands():
        if "GPU" not in comment:
            assert validate([*first_job(args)[0], f"results_dir={tmp_path}"]) == 1, args
    assert not list(tmp_path.iterdir())
