"""``Resumption``: what a process-group strategy does so that a run cut anywhere goes on, in one object.

It holds the three options and is called from the strategy's hooks (``process_group/services.py``):

- ``resume`` (``auto_resume.py``) and ``checkpoint_every`` (``safety_net.py``): when a ``fit`` sets up;
- the training loader's place in its epoch (``position.py``): a callback added when a ``fit`` sets
  up, which wraps the loader when Lightning prepares it;
- ``requeue_on_failure`` (``requeue_failed.py``): when the run fails, on the one rank that asks.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback

from lightning_mgpu.strategies.resume.auto_resume import AutoResume, ResumeHost, check_resume
from lightning_mgpu.strategies.resume.position import LoaderPosition
from lightning_mgpu.strategies.resume.requeue_failed import (
    check_requeue_on_failure,
    requeue_decision,
    scontrol,
)
from lightning_mgpu.strategies.resume.safety_net import check_checkpoint_every, install_safety_net

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["DEFAULTS", "Resumption", "check_options"]

log = logging.getLogger(__name__)

DEFAULTS: dict[str, Any] = {"resume": None, "checkpoint_every": "auto", "requeue_on_failure": 0}
"""The three options' defaults, the same in every strategy that takes them."""


def check_options(resume: object, checkpoint_every: object, requeue_on_failure: object) -> dict[str, Any]:
    """The three options by name, checked: ``ValueError`` naming the one that is none of those it accepts."""
    return {
        "resume": check_resume(resume),
        "checkpoint_every": check_checkpoint_every(checkpoint_every),
        "requeue_on_failure": check_requeue_on_failure(requeue_on_failure),
    }


class Resumption:
    """A strategy's ``resume``, ``checkpoint_every`` and ``requeue_on_failure``, and what they do.

    Args:
        host: The strategy.
        resume: See ``AutoResume``.
        checkpoint_every: See ``safety_net.install_safety_net``.
        requeue_on_failure: How many times a SLURM job may be requeued after a failed task.

    Raises:
        ValueError: An option that is none of those it accepts; the message names it.
    """

    def __init__(
        self,
        host: ResumeHost,
        resume: bool | None,
        checkpoint_every: int | timedelta | str | None,
        requeue_on_failure: int,
    ) -> None:
        self.host = host
        options = check_options(resume, checkpoint_every, requeue_on_failure)
        self.auto = AutoResume(host, options["resume"])
        self.checkpoint_every = options["checkpoint_every"]
        self.requeue_on_failure: int = options["requeue_on_failure"]
        self.position = LoaderPosition(host.strategy_name)
        self._first_step: int | None = None
        self._trainer: pl.Trainer | None = None

    def setup_fit(self, trainer: pl.Trainer, cluster_environment: Any) -> None:
        """Before a ``fit`` loads its checkpoint: the loader's position, the safety net, and the choice
        of the checkpoint."""
        callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning
        self.position = next((cb for cb in callbacks if isinstance(cb, LoaderPosition)), self.position)
        if self.position not in callbacks:
            callbacks.append(self.position)
        install_safety_net(trainer, self.checkpoint_every, self.host.strategy_name, cluster_environment)
        self.auto.install(trainer)
        self._trainer, self._first_step = trainer, None

    def on_train_start(self, trainer: pl.Trainer) -> None:
        self._first_step = trainer.global_step

    def after_failure(self, world_size: int, dead: Iterable[int]) -> None:
        """The run failed: the lowest rank not known dead asks SLURM for a requeue, where allowed."""
        if self.requeue_on_failure <= 0:
            return
        alive = sorted(set(range(world_size)) - set(dead))
        if not alive or alive[0] != self.host.global_rank:
            return
        trainer = self._trainer
        steps = trainer.global_step - self._first_step if trainer and self._first_step is not None else 0
        requeue, reason = requeue_decision(self.requeue_on_failure, os.environ, steps)
        job = os.environ.get("SLURM_JOB_ID", "")
        # one rank, maybe not rank 0, at the end of a failed run: a warning, which logging shows by default
        rank, name = self.host.global_rank, self.host.strategy_name
        said = f"[rank {rank}] {name}: SLURM job {job} after the failed task:"
        if requeue:
            # before the request: SLURM may end this process as soon as it requeues the job
            log.warning("%s requeuing (%s)", said, reason)
            ok, output = scontrol("requeue", job)
            if ok:
                return
            reason = f"scontrol requeue failed: {output}"
        log.warning("%s %s", said, reason)
