"""The grid launcher: one shared prefill per sample gives each configuration exactly what its own run gives.

In process: every registered method (two budgets, Keyformer's noise included) decoding from a copy of one shared
prefill sees bit-identical logits at every step to its own `generate`, and configurations decoding together in one
batch get their own tokens; KVzap and Fast KVzip (scores of each layer's input) beside SnapKV through `run_grid`
share one prefill and write the basic launcher's records. On the command line: a 3-method x 2-budget
sweep through `hydra/launcher=grid`, killed with SIGKILL in the middle and rerun with batched decoding, leaves the
same run directories, records and scores as Hydra's basic launcher (timings and memory aside).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from omegaconf import OmegaConf

from kvbench.engine.batching import generate
from kvbench.engine.batching import BatchedDecoder, Decoding, Request
from kvbench.engine.generation import Sampling
from kvbench.runs.grid import ConfigRun, GridJob, share_prefill
from kvbench.models import AttentionCapture
from kvbench.runs.config import sample_seed
from tests.unit.test_cli import grid_here, run_here
from tests.unit.test_contract import configured
from tests.unit.tiny import prompt, tiny_model

ROOT = Path(__file__).resolve().parents[2]
N, NEW = 150, 6
NAMES = ["full", "snapkv", "pyramidkv", "adakv", "streamingllm", "h2o", "keyformer", "buzz", "tailorkv", "quest",
         "pqcache", "kvzap", "fastkvzip"]  # (the last two score each layer's input: their own scores, one prefill)


def test_shared_prefill_gives_every_method_its_own_logits():
    model, ids = tiny_model("llama", layers=3), prompt(N)
    cfg, sample = OmegaConf.create({"seed": 3}), SimpleNamespace(id="s1", max_new_tokens=NEW)
    configs, budgets = [], []
    for name in NAMES:
        for budget in (32, 48):
            method = configured(name)
            if name == "pyramidkv":
                method.window = 4  # windows of different widths come from one capture of the widest
            configs.append(ConfigRun(GridJob(cfg, Path(name), {"method": name}), method, None, None))
            budgets.append(budget)
    for i, config in enumerate(configs):  # as `grid.plan` names them: softmax sums shared, Keyformer's own
        if config.job.choices["method"] in ("h2o", "buzz"):
            config.scorer = "softmax"
        elif config.job.choices["method"] == "keyformer":
            config.scorer = f"config{i}"

    def logits_of(config, budget, prefilled=None):
        seen = []
        with AttentionCapture(model) as capture:
            generate(model, None, config.method, capture, ids, budget, NEW, eos_ids=set(),
                     seed=sample_seed(cfg, sample), on_logits=lambda t, x: seen.append(x.clone()), prefilled=prefilled)
        return seen

    own = [logits_of(c, b) for c, b in zip(configs, budgets)]
    with AttentionCapture(model) as capture:
        shared = share_prefill(model, capture, configs, budgets, ids, sample)
    assert len({id(p.cache) for p in shared}) == 1  # one prefill for all 26 configurations
    for config, budget, prefilled, expected in zip(configs, budgets, shared, own):
        got = logits_of(config, budget, prefilled)
        assert len(got) == NEW and all(torch.equal(a, b) for a, b in zip(got, expected)), config.job.choices
    assert not torch.equal(own[2][-1], own[0][-1])  # compression changes the logits: the comparison can fail


def test_configurations_decoding_together_match_their_own_runs():
    """The grid's batched decoding: nine configurations of one sample in one continuous batch (4 at a time), from
    one shared prefill or their own, each with its own method state, sampling, positions and attention temperature,
    give the tokens and cache accounting of their own `generate`. Query and key weights are scaled up so attention
    is peaked: the tokens then depend on positions and temperature (a plain tiny model's barely do)."""
    model, ids, new = tiny_model("llama", layers=2), prompt(N), 10
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6)
            layer.self_attn.k_proj.weight.mul_(6)
    cfg, sample = OmegaConf.create({"seed": 3}), SimpleNamespace(id="s1", max_new_tokens=new)
    buzz_logn = configured("buzz")
    buzz_logn.logn = True  # a temperature on the model's attention: its own prefill, its own decode scaling
    settings = [(configured(name), Sampling(), "original") for name in ("snapkv", "adakv", "h2o", "keyformer",
                                                                          "tailorkv", "full")]
    settings += [(buzz_logn, Sampling(), "original"), (configured("streamingllm"), Sampling(), "shift"),
                 (configured("pyramidkv"), Sampling(do_sample=True, temperature=2.0, seed=5), "original")]
    configs = [ConfigRun(GridJob(cfg, Path(str(i)), {"method": m.registry_name}), m, None, None,
                         decoding=Decoding(m, sampling, positions))
               for i, (m, sampling, positions) in enumerate(settings)]
    for i, config in enumerate(configs):
        if config.job.choices["method"] == "h2o":
            config.scorer = "softmax"
        elif config.job.choices["method"] == "keyformer":
            config.scorer = f"config{i}"
    budget, seed = 40, sample_seed(cfg, sample)
    with AttentionCapture(model) as capture:
        alone = [generate(model, None, c.method, capture, ids, budget, new, sampling=c.decoding.sampling,
                          eos_ids=set(), positions=c.decoding.positions, seed=seed) for c in configs]
        shared = share_prefill(model, capture, configs[:6], [budget] * 6, ids, sample)
        requests = [Request(ids, budget, new, seed=seed, tag=i, decoding=c.decoding,
                            prefilled=shared[i] if i < 6 else None) for i, c in enumerate(configs)]
        decoder = BatchedDecoder(model, None, configs[0].method, capture, 4, eos_ids=set())
        done = {r.tag: g for r, g in decoder.run(requests)}
    assert all(r.prefilled is None for r in requests)  # the shared prefill is let go once each copy is made
    for i, expected in enumerate(alone):
        assert done[i].token_ids == expected.token_ids, configs[i].job.choices
        assert done[i].kept_per_head == expected.kept_per_head and done[i].kv_bytes_final == expected.kv_bytes_final
    assert len({tuple(g.token_ids) for g in alone}) > 2  # the configurations really differ: the check can fail


# --- the command line -------------------------------------------------------------------------------------------
# two samples are enough for a kill in the middle (faulty.HeldNeedle holds each configuration in its second sample);
# each process costs seconds of imports, each sample more generations of every configuration
# one metric: what this test checks is the launcher; ROUGE's import (nltk) costs each process ~1.3 s of CPU
SWEEP = ["-m", "model=tiny_llama", "method=full,pyramidkv,keyformer", "budget=40,64", "report=false",
         "dataset.context_lengths=[300,400]", "dataset.depth_percents=[50]", "dataset.metrics=[pyramidkv_recall]"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1"}
VOLATILE = {"prefill_s", "compress_s", "decode_s", "decode_tok_s", "e2e_s", "peak_mem_bytes", "peak_kv_bytes",
            "prefill_shared_by", "prefill_s_mean", "decode_tok_s_mean"}


def command(results: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "kvbench.run", *SWEEP, *extra, f"results_dir={results}"]


def outputs(results: Path) -> dict[str, tuple[list[dict], dict]]:
    """Per run dir (relative): its records in file order and scores.json, without timings and memory."""
    out = {}
    for path in sorted(results.rglob("predictions.jsonl")):
        recs = [{k: v for k, v in json.loads(line).items() if k not in VOLATILE}
                for line in path.read_text().splitlines()]
        scores = {k: v for k, v in json.loads((path.parent / "scores.json").read_text()).items() if k not in VOLATILE}
        out[str(path.parent.relative_to(results))] = (sorted(recs, key=lambda r: r["id"]), scores)
    return out


def count_lines(results: Path) -> int:
    return sum(len(p.read_bytes().splitlines()) for p in results.rglob("predictions.jsonl"))


def test_grid_equals_basic_launcher_with_a_kill_in_the_middle(tmp_path):
    """The grid is killed once it has written records and its datasets (faulty.HeldNeedle, one per configuration)
    hold it in the second sample: it cannot have finished first, however fast the machine."""
    basic, grid, release = tmp_path / "basic", tmp_path / "grid", tmp_path / "release"
    held = ["dataset._target_=tests.unit.faulty.HeldNeedle", f"+dataset.release={release}"]
    release.touch()
    # the basic launcher's jobs, in this process: each configuration's run (full once: its run dir has no budget)
    jobs = [("full", 40), ("pyramidkv", 40), ("pyramidkv", 64), ("keyformer", 40), ("keyformer", 64)]
    fixed = [a for a in SWEEP if a != "-m" and not a.startswith(("method=", "budget="))]
    for method, budget in jobs:
        run_here(*fixed, *held, f"method={method}", f"budget={budget}", results=basic)
    expected = outputs(basic)
    assert len(expected) == 5 and {d.split("/")[2] for d in expected} == {"full", "pyramidkv", "keyformer"}
    assert all(len(recs) == 2 for recs, _ in expected.values())  # full once, not once per budget

    release.unlink()
    proc = subprocess.Popen(command(grid, "hydra/launcher=grid", *held), cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while count_lines(grid) < 3 and proc.poll() is None:  # no deadline a loaded machine could reach
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)  # a hard kill: no cleanup, maybe a torn line
    proc.wait()
    partial = count_lines(grid)
    assert 3 <= partial <= 5, partial  # killed in the middle of the grid: at most each configuration's first record
    release.touch()
    # the rerun decodes 3 generations at once (configurations of a sample together): the same records
    again = subprocess.run(command(grid, "hydra/launcher=grid", "batch_size=3", *held), cwd=ROOT, env=ENV,
                           capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert outputs(grid) == expected
    manifest = json.loads(next(grid.rglob("keyformer/b40-*/manifest.json")).read_text())
    assert manifest["launcher"] == "grid" and manifest["finished_utc"] and manifest["n_samples"] == 2


# --- methods that score each layer's input, through `run_grid` in this process ------------------------------------
INPUTS = ["model=tiny_llama", "budget=64", "report=false", "dataset.context_lengths=[300]",
          "dataset.depth_percents=[50]", "dataset.metrics=[pyramidkv_recall]", "dataset.max_new_tokens=4"]
SCORING_INPUTS = [["method=kvzap", "method.weights=random", "method.window=16", "method.threshold=0"],
                  ["method=fastkvzip", "method.gates=random"], ["method=snapkv"]]


def test_methods_scoring_the_inputs_share_the_prefill_and_equal_the_basic_launcher(tmp_path):
    """KVzap and Fast KVzip read each layer's input at prefill: the grid's one prefill per sample scores it for each
    of them, beside SnapKV's window; the three decode together (batch_size=3), and every record equals the basic
    launcher's."""
    for overrides in SCORING_INPUTS:
        run_here(*INPUTS, *overrides, results=tmp_path / "basic")
    grid_here([[*INPUTS, *overrides, "batch_size=3"] for overrides in SCORING_INPUTS], tmp_path / "grid")
    expected, got = outputs(tmp_path / "basic"), outputs(tmp_path / "grid")
    assert len(expected) == 3 and all("error" not in r for recs, _ in expected.values() for r in recs)
    assert all(r["kv_bytes"] < r["full_kv_bytes"] for recs, _ in expected.values() for r in recs)  # all evict
    assert got == expected
    shared = [json.loads(line)["prefill_shared_by"] for path in (tmp_path / "grid").rglob("predictions.jsonl")
              for line in path.read_text().splitlines()]
    assert shared == [3] * 3  # one prefill for the sample, shared by the three configurations
