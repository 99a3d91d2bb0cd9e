"""``checkpoint_every``: a resumable checkpoint every N minutes or steps, so that a restart loses little.

A restart resumes from the newest complete checkpoint, and a run whose only checkpoints come at the
end of long epochs loses up to an epoch. ``checkpoint_every`` adds a :class:`ResumeCheckpoint`
(``checkpoint.py``), which keeps only its newest checkpoint:

- ``"auto"`` (the default): every :data:`DEFAULT_PERIOD`, where the run can be restarted (torchrun
  with ``--max-restarts`` above 0, a SLURM job that may be requeued), unless the Trainer has
  checkpointing off (``enable_checkpointing=False``); nowhere else;
- a ``timedelta``: that often; an ``int``: every that many optimizer steps; ``None``: never.

Its folder is ``<default_root_dir>/resume``; the old checkpoint is removed only once the new one is
complete, so a kill while saving leaves the previous one to resume from. Each save costs what any
checkpoint of the run costs; ``benchmarks/resume.py`` measures it and the time checks.
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_mgpu.strategies.resume.checkpoint import ResumeCheckpoint

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["DEFAULT_PERIOD", "check_checkpoint_every", "install_safety_net", "restartable"]

log = logging.getLogger(__name__)

DEFAULT_PERIOD = timedelta(minutes=30)
"""How often ``checkpoint_every="auto"`` saves where the run can be restarted."""


def check_checkpoint_every(every: object) -> int | timedelta | str | None:
    """``every`` as given, or ``ValueError`` naming what is accepted."""
    steps = isinstance(every, int) and not isinstance(every, bool) and every > 0
    period = isinstance(every, timedelta) and every.total_seconds() > 0
    if every is None or every == "auto" or steps or period:
        return every  # type: ignore[return-value]
    raise ValueError(
        "checkpoint_every must be 'auto' (every 30 minutes where the run can be restarted), a positive"
        f" number of steps, a positive datetime.timedelta or None (never), got {every!r}"
    )


def _slurm_requeues(job_id: str) -> bool:
    """Whether SLURM may requeue job ``job_id`` (``scontrol show job``'s ``Requeue=1``)."""
    try:
        shown = subprocess.run(
            ["scontrol", "show", "job", job_id, "--oneliner"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError) as err:
        log.debug("scontrol show job %s: %s", job_id, err)
        return False
    return "Requeue=1" in shown.split()


def restartable(environ: Mapping[str, str], cluster_environment: Any) -> str | None:
    """What may restart this run (``"torchrun --max-restarts=2"``, ``"SLURM's requeue"``), or ``None``."""
    try:
        restarts = int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        restarts = 0
    if restarts > 0:
        return f"torchrun --max-restarts={restarts}"
    if isinstance(cluster_environment, SLURMEnvironment) and cluster_environment.auto_requeue:
        job = environ.get("SLURM_JOB_ID", "")
        if int(environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0 or (job and _slurm_requeues(job)):
            return "SLURM's requeue"
    return None


def install_safety_net(
    trainer: pl.Trainer, every: int | timedelta | str | None, name: str, cluster_environment: Any
) -> ResumeCheckpoint | None:
    """Add the :class:`ResumeCheckpoint` ``every`` asks for to ``trainer`` (once), and say so on rank 0."""
    callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's connector
    if every is None or any(isinstance(cb, ResumeCheckpoint) for cb in callbacks):
        return None
    why = "checkpoint_every"
    if every == "auto":
        restarter = restartable(os.environ, cluster_environment)
        if restarter is None or not trainer.checkpoint_callbacks:
            log.debug("no safety net: restarter %s, checkpoints %s", restarter, trainer.checkpoint_callbacks)
            return None
        every, why = DEFAULT_PERIOD, f"the run can be restarted ({restarter})"
    folder = Path(trainer.default_root_dir) / "resume"
    callback = ResumeCheckpoint(folder, every)  # type: ignore[arg-type]  # "auto" and None are gone
    callbacks.append(callback)
    period = f"{every} steps" if isinstance(every, int) else f"{every.total_seconds() / 60:g} minutes"  # type: ignore[union-attr]
    rank_zero_info(f"{name}: {why}: a resumable checkpoint every {period} in {folder}")
    return callback
