"""The load benchmark's settings live in configs/serving/ and become a `ServingSpec` checked before any weights load:
the file's defaults are the dataclass's, a command line's `serving.*` values land in the spec, and every bad value is
one line naming the key, its value and the valid range or choices (no model is loaded here: nothing is written)."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from kvbench.serving.__main__ import parse
from kvbench.serving.spec import CONFIG_DIR, FIELDS, ServingSpec, serving_node


def test_the_default_file_holds_every_field_at_the_dataclass_default():
    raw = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "default.yaml"))
    assert tuple(raw) == FIELDS  # field for field, in order
    defaults = {f.name: f.default for f in dataclasses.fields(ServingSpec)}
    assert raw == defaults


def test_the_command_line_round_trips_into_the_spec():
    _, (serving,) = parse(["serving.pool_requests=2.5", "serving.arrival=concurrency", "serving.concurrency=3",
                           "serving.max_batch=8", "serving.ttft_slo_s=4", "serving.limit=6",
                           "serving.results_dir=/tmp/x"])
    assert serving == ServingSpec(pool_requests=2.5, arrival="concurrency", concurrency=3, max_batch=8,
                                  ttft_slo_s=4.0, limit=6, results_dir="/tmp/x")
    assert serving.slo_s == (4.0, float("inf"))  # no TPOT target: every request meets it
    node = serving_node("default", {"pool_bytes": 1000})
    assert ServingSpec.from_config(node) == ServingSpec(pool_bytes=1000)


@pytest.mark.parametrize("arg, says", [
    ("serving.pool_requests=-1", "serving.pool_requests=-1 must be"),
    ("serving.pool_bytes=abc", "serving.pool_bytes='abc'"),
    ("serving.arrival=closed", "serving.arrival='closed' is not one of burst, poisson, concurrency"),
    ("serving.max_batch=0", "serving.max_batch=0 must be"),
    ("serving.tpot_slo_s=0", "serving.tpot_slo_s=0 must be"),
    ("serving.limit=0", "serving.limit=0"),
    ("serving.pool=3", "no setting 'pool'; valid: arrival, concurrency"),
    ("serving=fast", "Unknown serving preset 'fast'. Available: default"),
])
def test_a_bad_value_is_one_line(arg, says):
    with pytest.raises(ValueError) as e:
        parse(["serving.pool_bytes=1000" if "pool_bytes" not in arg else "serving.limit=2", arg])
    assert says in str(e.value) and "\n" not in str(e.value)


def test_the_command_refuses_before_weights_load(tmp_path):
    """The real command, in a process: a bad value exits with one `kvbench:` line and writes nothing."""
    done = subprocess.run([sys.executable, "-m", "kvbench.serving", "model=tiny_llama", "method=snapkv",
                           "serving.pool_requests=0", f"serving.results_dir={tmp_path}"],
                          capture_output=True, text=True, cwd=CONFIG_DIR.parents[1])
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1].startswith("kvbench: serving: serving.pool_requests=0 must be")
    assert "Loading" not in done.stderr and list(tmp_path.iterdir()) == []
