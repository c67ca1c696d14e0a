"""Cluster launchers with real processes: submitit's local executor (what SLURM runs) and a local Ray instance."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from kvbench.runs.config import CONFIG_DIR
from tests.unit.test_cli import ENV, ROOT, records

# one metric: what these tests check is the launch; ROUGE's import (nltk) costs each process ~1.3 s of CPU
SWEEP = ["model=tiny_llama", "method=snapkv,pyramidkv", "shard=0/2,1/2", "budget=64",
         "dataset.metrics=[pyramidkv_recall]"]


def sweep_dirs(results) -> dict[str, object]:
    return {p.parent.parent.name: p.parent for p in results.rglob("scores.json")}


def check_merged(results, n: int) -> dict:
    """Both methods' run dirs were merged by their last shard: n ids, each exactly once, and the shards' costs."""
    dirs = sweep_dirs(results)
    assert set(dirs) == {"snapkv", "pyramidkv"}
    for run_dir in dirs.values():
        ids = [r["id"] for r in records(run_dir)]
        assert len(ids) == len(set(ids)) == n
        manifest = json.loads((run_dir / "manifest.json").read_text())
        assert set(manifest["shards"]) == {"shard-0-of-2", "shard-1-of-2"} and manifest["n_samples"] == n
    return dirs


# configs/hydra/launcher/ray.yaml extends the plugin's `ray` under its name; Hydra warns about that on compose
@pytest.mark.filterwarnings(r"ignore:\s*'hydra/launcher/ray' is validated against ConfigStore schema")
@pytest.mark.parametrize("launcher,key,expected", [
    ("slurm", "hydra.launcher.gpus_per_node", {"tiny_llama": 0, "llama3_8b_instruct": 1}),
    ("slurm", "hydra.launcher.mem_gb", {"tiny_llama": 8, "llama3_8b_instruct": 64}),
    ("ray", "hydra.launcher.ray.remote.num_gpus", {"tiny_llama": 0, "llama3_8b_instruct": 1}),
])
def test_launchers_ask_for_what_the_model_config_names(launcher, key, expected):
    for model, value in expected.items():
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = compose("config", overrides=[f"hydra/launcher={launcher}", f"model={model}"],
                          return_hydra_config=True)
        assert OmegaConf.select(cfg, key) == value


def test_submitit_sweep_of_configs_x_shards_requeues_a_preempted_job(tmp_path):
    """`-m hydra/launcher=local method=snapkv,pyramidkv shard=0/2,1/2` (configs/hydra/launcher/local.yaml: submitit's
    local executor, what `slurm` does on a cluster): four real jobs, one process per configuration and shard. One
    gets SIGUSR2 mid-run (what SLURM sends before a timeout or preemption): submitit checkpoints, requeues it, and the
    requeued job resumes from its predictions file instead of starting over. Every job is held after its first record
    (faulty.HeldNeedle) until the signal has been sent, so none can finish first, however fast the machine."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    release = tmp_path / "release"
    grid = ["dataset.context_lengths=[300,400,500]", "dataset.depth_percents=[0,25,50,75]",
            "dataset._target_=tests.unit.faulty.HeldNeedle", f"+dataset.release={release}"]
    proc = subprocess.Popen([sys.executable, "-m", "kvbench.run", "-m", "hydra/launcher=local", *SWEEP,
                             *grid, f"results_dir={tmp_path}"], cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    shard_file = None  # waits as long as the job runs: no deadline a loaded machine could reach
    try:
        while proc.poll() is None:
            shard_file = next(tmp_path.rglob("snapkv/*/predictions.shard-0-of-2.jsonl"), None)
            if shard_file is not None and shard_file.read_text().count("\n") >= 1:
                break
            time.sleep(0.02)
        holder = (shard_file.parent / ".lock.shard-0-of-2").read_text().split()  # "<host> pid <pid>"
        written = shard_file.read_text().splitlines()
        os.kill(int(holder[2]), signal.SIGUSR2)
    finally:
        release.touch()  # the other jobs, and the requeued one, may go on (also if this test failed)
    assert len(written) == 1
    _, err = proc.communicate()
    assert proc.returncode == 0, err

    dirs = check_merged(tmp_path, n=12)
    resumed = (dirs["snapkv"] / "predictions.shard-0-of-2.jsonl").read_text().splitlines()
    assert resumed[:len(written)] == written and len(resumed) == 6  # resumed, not redone
    sessions = json.loads((dirs["snapkv"] / "manifest.shard-0-of-2.json").read_text())["cost"]["sessions"]
    assert len(sessions) == 2 and sessions[0]["job_id"] == sessions[1]["job_id"]  # the same job, requeued
    logs = dirs["snapkv"] / "logs"
    out_log = logs / f"shard-0-of-2.job-{sessions[0]['job_id']}.out"
    assert out_log.is_symlink() and "Requeued job" in out_log.read_text()
    assert "Caught signal SIGUSR2" in (logs / f"shard-0-of-2.job-{sessions[0]['job_id']}.err").read_text()
    assert len(list(logs.glob("shard-1-of-2.job-*.out"))) == 1


def test_ray_sweep_of_configs_x_shards_on_a_local_ray(tmp_path):
    """`-m hydra/launcher=ray method=snapkv,pyramidkv shard=0/2,1/2` through hydra-ray-launcher on a local Ray
    instance held to 2 CPUs: one Ray task per (config, shard), each asking for model.gpus=0 GPUs."""
    pytest.importorskip("hydra_plugins.hydra_ray_launcher")
    out = subprocess.run([sys.executable, "-m", "kvbench.run", "-m", "hydra/launcher=ray", *SWEEP,
                          "dataset.context_lengths=[300]", "dataset.depth_percents=[0,50,100]",
                          "hydra.launcher.ray.init.num_cpus=2", f"results_dir={tmp_path}"],
                         cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    check_merged(tmp_path, n=3)
    assert out.stdout.count("(_run_job pid=") + out.stderr.count("(_run_job pid=") > 0  # ran inside Ray workers
    assert "validated against ConfigStore schema" not in out.stderr


def test_where_a_run_executes_is_not_part_of_its_identity():
    """shard, GPUs, memory and device map change where a run executes, not what it computes: same run dir hash."""
    from kvbench.runs.config import config_hash

    def run_hash(*overrides):
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            c = compose("config", overrides=["model=tiny_llama", *overrides])
        return config_hash(c.method, c.dataset, c.model, c.generation, c.seed, c.positions)

    assert run_hash() == run_hash("shard=1/4", "model.gpus=4", "model.mem_gb=512", "model.device_map=auto")
    assert run_hash() != run_hash("model.dtype=bfloat16")
