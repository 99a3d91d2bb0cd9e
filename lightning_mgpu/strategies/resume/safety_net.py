"""``checkpoint_every``: a resumable checkpoint every N minutes or steps, so that a restart loses little.

A restart resumes from the newest complete checkpoint, and a run whose only checkpoints come at the
end of long epochs loses up to an epoch. ``checkpoint_every`` adds a :class:`ResumeCheckpoint`,
which keeps only its newest checkpoint:

- ``"auto"`` (the default): every :data:`DEFAULT_PERIOD`, where the run can be restarted (torchrun
  with ``--max-restarts`` above 0, a SLURM job that may be requeued), unless the Trainer has
  checkpointing off (``enable_checkpointing=False``); nowhere else;
- a ``timedelta``: that often; an ``int``: every that many optimizer steps; ``None``: never.

Its folder is ``<default_root_dir>/resume``; the old checkpoint is removed only once the new one is
complete, so a kill while saving leaves the previous one to resume from. Each save costs what any
checkpoint of the run costs; ``benchmarks/resume.py`` measures it and the time checks.

By time, ``ResumeCheckpoint`` does not use Lightning's ``ModelCheckpoint(train_time_interval=...)``,
which lets rank 0 decide whether the time has come and broadcasts its decision as a pickled object at
every training batch: a collective per step, which on two CPU processes costs about as much as a
small model's step. Here rank 0 plans instead (``plan_check``): at a check it says whether to save
now and at which later step to check again, half the steps its step time leaves to the deadline;
every rank has the same plan, so the check is one broadcast at steps all ranks agree on, about
log2(period / step time) of them per period (a dozen or two), and the save comes within a step of
the deadline. By steps (an ``int``) it is Lightning's ``every_n_train_steps``.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_mgpu._compat.lightning import save_top_k, skips_saving
from lightning_mgpu.strategies.resume.requeue_failed import scontrol
from lightning_mgpu.strategies.resume.restart import env_count

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "DEFAULT_PERIOD",
    "ResumeCheckpoint",
    "check_checkpoint_every",
    "install_safety_net",
    "plan_check",
    "restartable",
]

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


def plan_check(
    step: int, now: float, last_save: float, last_check: tuple[int, float] | None, period: float
) -> tuple[bool, int]:
    """Rank 0's plan at a check: (save now, the step of the next check).

    ``last_check`` is the (step, time) of the previous check, from which the step time is read;
    the next check comes after half the steps left to the deadline, and at least one step later.
    """
    left = period - (now - last_save)
    due = left <= 0
    if due:
        left = period
    if last_check is None or step <= last_check[0]:
        return due, step + 1
    step_time = max((now - last_check[1]) / (step - last_check[0]), 1e-6)
    return due, step + max(1, math.floor(0.5 * left / step_time))


class ResumeCheckpoint(ModelCheckpoint):
    """Saves a resumable checkpoint every ``every`` steps or every ``every`` (a ``timedelta``), newest only.

    Args:
        dirpath: The folder of its checkpoints (``resume-epoch=E-step=S.ckpt``).
        every: Optimizer steps (``int``) or time (``timedelta``) between two saves.
    """

    def __init__(self, dirpath: str | Path, every: int | timedelta) -> None:
        steps = every if isinstance(every, int) else 0
        super().__init__(
            dirpath=dirpath,
            filename="resume-{epoch}-{step}",
            save_top_k=1,
            every_n_train_steps=steps,
            every_n_epochs=0,
        )
        self.period = every.total_seconds() if isinstance(every, timedelta) else None
        """Seconds between two saves; ``None`` when saving by steps."""
        self._next_check = 0
        self._last_save = 0.0
        self._last_check: tuple[int, float] | None = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._next_check, self._last_save, self._last_check = trainer.global_step, time.monotonic(), None

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.period is None:
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        step = trainer.global_step
        if step < self._next_check or skips_saving(self, trainer):
            return None
        now = time.monotonic()
        plan = plan_check(step, now, self._last_save, self._last_check, self.period)
        due, self._next_check = trainer.strategy.broadcast(plan)
        self._last_check = (step, now)
        log.debug("step %d: save %s, next check at step %d", step, due, self._next_check)
        if due:
            self._last_save = now
            save_top_k(self, trainer)
        return None


def _slurm_requeues(job_id: str) -> bool:
    """Whether SLURM may requeue job ``job_id`` (``scontrol show job``'s ``Requeue=1``)."""
    ok, shown = scontrol("show", "job", job_id, "--oneliner")
    log.debug("scontrol show job %s: %s", job_id, shown)
    return ok and "Requeue=1" in shown.split()


def restartable(environ: Mapping[str, str], cluster_environment: Any) -> str | None:
    """What may restart this run (``"torchrun --max-restarts=2"``, ``"SLURM's requeue"``), or ``None``."""
    restarts = env_count(environ, "TORCHELASTIC_MAX_RESTARTS")
    if restarts > 0:
        return f"torchrun --max-restarts={restarts}"
    if isinstance(cluster_environment, SLURMEnvironment) and cluster_environment.auto_requeue:
        job = environ.get("SLURM_JOB_ID", "")
        if env_count(environ, "SLURM_RESTART_COUNT") > 0 or (job and _slurm_requeues(job)):
            return "SLURM's requeue"
    return None


def install_safety_net(
    trainer: pl.Trainer, every: int | timedelta | str | None, name: str, cluster_environment: Any
) -> None:
    """Add the :class:`ResumeCheckpoint` ``every`` asks for to ``trainer`` (once), and say so on rank 0."""
    callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's connector
    if every is None or any(isinstance(cb, ResumeCheckpoint) for cb in callbacks):
        return
    why = "checkpoint_every"
    if every == "auto":
        restarter = restartable(os.environ, cluster_environment)
        if restarter is None or not trainer.checkpoint_callbacks:
            log.debug("no safety net: restarter %s, checkpoints %s", restarter, trainer.checkpoint_callbacks)
            return
        every, why = DEFAULT_PERIOD, f"the run can be restarted ({restarter})"
    folder = Path(trainer.default_root_dir) / "resume"
    callbacks.append(ResumeCheckpoint(folder, every))  # type: ignore[arg-type]  # "auto" and None are gone
    period = f"{every} steps" if isinstance(every, int) else f"{every.total_seconds() / 60:g} minutes"  # type: ignore[union-attr]
    rank_zero_info(f"{name}: {why}: a resumable checkpoint every {period} in {folder}")
