"""What a run cost: wall time, GPU-seconds and hosts, per run or shard, added up over resumes and requeues.

GPU-seconds are what a cluster bills: wall time x the GPUs the process holds (the distinct CUDA devices the model's
weights sit on; 0 on a CPU run). A requeued or resumed job adds a session instead of restarting the count, and the
manifest is rewritten after every sample, so a job killed without warning loses at most one sample's time.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

logger = logging.getLogger(__name__)


def model_gpus(model) -> int:
    """Distinct CUDA devices holding the model's weights (a `device_map=auto` model spans several)."""
    return len({p.device for p in model.parameters() if p.device.type == "cuda"})


@dataclass
class CostMeter:
    """This process's session, plus the sessions an earlier manifest of the same run (or shard) recorded."""

    gpus: int
    earlier: list[dict] = field(default_factory=list)
    host: str = field(default_factory=socket.gethostname)
    started_utc: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    t0: float = field(default_factory=time.perf_counter)

    @classmethod
    def resume(cls, model, old_manifest: dict | None, t0: float | None = None) -> "CostMeter":
        """Start this session's clock at `t0` (a `time.perf_counter()` value), after the earlier sessions."""
        earlier = list(((old_manifest or {}).get("cost") or {}).get("sessions", []))
        return cls(gpus=model_gpus(model), earlier=earlier, **({"t0": t0} if t0 is not None else {}))

    def session(self) -> dict:
        wall_s = round(time.perf_counter() - self.t0, 3)
        return {"host": self.host, "started_utc": self.started_utc, "wall_s": wall_s, "gpus": self.gpus,
                "gpu_s": round(wall_s * self.gpus, 3), "job_id": _job_id()}

    def fields(self) -> dict:
        """The manifest's `cost` entry: totals over sessions, and the sessions themselves."""
        return {"cost": totals([*self.earlier, self.session()])}


def totals(sessions: list[dict]) -> dict:
    """Sum sessions (of one shard, or of all shards of a run) into the manifest's `cost` entry."""
    return {"wall_s": round(sum(s["wall_s"] for s in sessions), 3),
            "gpu_s": round(sum(s["gpu_s"] for s in sessions), 3),
            "hosts": sorted({s["host"] for s in sessions}), "sessions": sessions}


def _job_id() -> str | None:
    """The scheduler's job id (SLURM array task, submitit local job), if any."""
    if os.environ.get("SLURM_ARRAY_JOB_ID"):
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}"
    return os.environ.get("SLURM_JOB_ID") or os.environ.get("SUBMITIT_LOCAL_JOB_ID")


def job_log_links(run_dir: Path, shard=None) -> None:
    """Inside a submitit job (SLURM or local), link the job's stdout/stderr into `<run dir>/logs/`, so each job's
    logs sit with the run (and shard) it worked on although submitit writes them under the sweep's `.submitit/`."""
    if not os.environ.get("SUBMITIT_FOLDER"):
        return
    try:
        import submitit

        env = submitit.JobEnvironment()
        paths = env.paths
        logs = Path(run_dir) / "logs"
        logs.mkdir(exist_ok=True)
        stem = f"{shard.tag + '.' if shard is not None else ''}job-{env.job_id}"
        for target, suffix in ((paths.stdout, "out"), (paths.stderr, "err")):
            link = logs / f"{stem}.{suffix}"
            if not link.is_symlink():
                link.symlink_to(Path(target).resolve())
    except Exception as e:  # logs are a convenience; never fail a job over them
        logger.warning("could not link the job's logs into %s/logs: %s", run_dir, e)
