"""SLURM's requeue signal acted on at the start of the next batch, by every rank at once.

Lightning's ``SLURMEnvironment(auto_requeue=True)`` (the default under ``srun``) saves
``hpc_ckpt_<n>.ckpt`` and runs ``scontrol requeue`` from inside its signal handler, wherever
each rank happens to be when the signal arrives: in the middle of a step, with the loop's
counters half-updated, or with one rank already in a collective the other has not reached.
Saved there, a resumed run can skip or repeat batches, and the save's own collectives can meet
the wrong ones. ``DeferredRequeue`` keeps Lightning's handler and only moves it: the signal sets a
flag, and at the start of each training batch the ranks agree (one all-reduce) whether any of
them received it; if so every rank calls Lightning's handler there, between two batches, where
Lightning's own step checkpoints are taken and from which it resumes exactly.
"""

from __future__ import annotations

import logging
import signal
from types import FrameType
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_mgpu._compat.lightning import cluster_environment, is_slurm_requeue_handler, run_slurm_requeue

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["DeferredRequeue"]

log = logging.getLogger(__name__)


class DeferredRequeue:
    """Moves Lightning's SLURM requeue handler from the moment of the signal to the next batch start."""

    def __init__(self) -> None:
        self._trainer: pl.Trainer | None = None
        self._signum: int | None = None
        self._received = False

    def install(self, trainer: pl.Trainer) -> None:
        """Take the requeue signal over from Lightning's handler, when Lightning set one for SLURM."""
        environment = cluster_environment(trainer)
        if not isinstance(environment, SLURMEnvironment) or not environment.auto_requeue:
            return
        signum = environment.requeue_signal or signal.SIGUSR1
        if not is_slurm_requeue_handler(signal.getsignal(signum)):
            log.debug("signal %s has a handler other than Lightning's requeue: left alone", signum)
            return
        signal.signal(signum, self._note)
        self._trainer, self._signum, self._received = trainer, int(signum), False
        log.debug("SLURM's requeue signal %s is acted on at the next batch start", signum)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self._received = True

    def at_batch_start(self, device: torch.device) -> None:
        """Agree with the other ranks whether the signal came; if so, Lightning's handler runs here."""
        if self._trainer is None or self._signum is None:
            return
        flag = torch.tensor([float(self._received)], device=device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return
        trainer, signum = self._trainer, self._signum
        self._trainer = None  # once: SLURM ends this attempt after the requeue
        batch = trainer.fit_loop.epoch_loop.batch_idx
        rank_zero_info(
            f"SLURM's requeue signal came: every rank saves at the start of batch {batch} of epoch"
            f" {trainer.current_epoch} (global step {trainer.global_step}), then the job is requeued"
        )
        run_slurm_requeue(trainer, signum)
