"""`python -m kvbench.run -m hydra/launcher=grid method=snapkv,pyramidkv budget=64,128`: one prefill per sample.

Hydra hands a launcher the sweep's jobs as override lists. This one resolves each job exactly as Hydra's basic
launcher does (`run_job`: sweep config, run directory, `.hydra/` files, per-job logging), but with a task function
that only collects the resolved config; `kvbench.runs.grid` then runs the collected jobs sample-major, sharing each
sample's prefill across the configurations that share model and dataset. Each job's run directory, records,
manifest and scores.json are the basic launcher's; a rerun resumes. Bad input exits with one `kvbench:` line
before any weights load. Heavy imports wait for `launch`: Hydra imports every plugin on every start (and
executes this module outside sys.modules, so no `from __future__ import annotations` with the dataclass below).
"""

import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict

log = logging.getLogger(__name__)


@dataclass
class GridLauncherConf:
    _target_: str = "hydra_plugins.kvbench_grid_launcher.grid_launcher.GridLauncher"


ConfigStore.instance().store(group="hydra/launcher", name="grid", node=GridLauncherConf, provider="kvbench")


class GridLauncher(Launcher):
    def __init__(self) -> None:
        super().__init__()
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context  # the task function is not called: kvbench.runs.grid runs the jobs

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from kvbench.runs.grid import run_grid

        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        log.info(f"Launching {len(job_overrides)} jobs as one grid (shared prefill per sample)")
        jobs, returns = [], []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(sweep_config):
                sweep_config.hydra.job.id = sweep_config.hydra.job.num = idx
            returns.append(run_job(hydra_context=self.hydra_context, task_function=lambda cfg: _collect(cfg, jobs),
                                   config=sweep_config, job_dir_key="hydra.sweep.dir",
                                   job_subdir_key="hydra.sweep.subdir"))
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        try:
            summaries = run_grid(jobs)
        except (ValueError, KeyError, FileNotFoundError) as e:
            message = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
            sys.exit(f"kvbench: {message}")
        except RuntimeError as e:  # e.g. a run dir held by another process (store.RunDirBusy)
            sys.exit(f"kvbench: {e}")
        except KeyboardInterrupt:  # every finished sample is on disk: a rerun resumes
            print("kvbench: interrupted; every finished sample is kept, rerun the same command to resume",
                  file=sys.stderr)
            sys.exit(130)
        for ret, job in zip(returns, jobs):
            ret.return_value, ret.status = summaries[job.run_dir], JobStatus.COMPLETED
        return returns


def _collect(cfg: DictConfig, jobs: list) -> None:
    """The task function Hydra runs per job: remember the resolved config, its run directory and group choices."""
    from kvbench.runs.grid import GridJob

    runtime = HydraConfig.get().runtime
    jobs.append(GridJob(cfg, Path(runtime.output_dir), {k: runtime.choices[k] for k in ("method", "dataset", "model")}))
