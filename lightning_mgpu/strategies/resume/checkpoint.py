"""``ResumeCheckpoint``: the safety net's ``ModelCheckpoint``, every N steps or every so many minutes.

Lightning's ``ModelCheckpoint(train_time_interval=...)`` lets rank 0 decide whether the time has
come and broadcasts its decision as a pickled object at every training batch: a collective per
step, which on two CPU processes costs about as much as a small model's step. Here rank 0 plans
instead: at a check it says whether to save now and at which later step to check again, half the
steps its step time leaves to the deadline; every rank has the same plan, so the check is one
broadcast at steps all ranks agree on, about log2(period / step time) of them per period (a
dozen or two), and the save comes within a step of the deadline.

By steps (an ``int``) it is Lightning's ``every_n_train_steps``. Either way the newest checkpoint
is kept and the previous one removed only once the new one is written (``save_top_k=1``).
"""

from __future__ import annotations

import logging
import math
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["ResumeCheckpoint", "plan_check"]

log = logging.getLogger(__name__)


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
        if step < self._next_check or self._should_skip_saving_checkpoint(trainer):
            return None
        now = time.monotonic()
        plan = plan_check(step, now, self._last_save, self._last_check, self.period)
        due, self._next_check = trainer.strategy.broadcast(plan)
        self._last_check = (step, now)
        log.debug("step %d: save %s, next check at step %d", step, due, self._next_check)
        if due:
            self._last_save = now
            self._save_topk_checkpoint(trainer, self._monitor_candidates(trainer))
        return None
