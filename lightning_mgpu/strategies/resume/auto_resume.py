"""A restarted run resumes by itself from the newest complete checkpoint of the run: ``AutoResume``.

Lightning resumes only from the ``ckpt_path`` given to ``fit`` (under SLURM, from the newest
``hpc_ckpt_<n>.ckpt`` when there is one, complete or not). ``AutoResume`` takes the place of that
choice when ``fit`` got no ``ckpt_path``:

- on by default only when the run is a restart (torchrun's or SLURM's count above 0 on any
  rank, or the record of an unfinished earlier attempt of the same run in its checkpoint folder,
  ``attempt_record.py``), always with ``resume=True``, never with ``resume=False``;
- rank 0 lists the checkpoints (``candidates.py``), newest first, leaves out on a restart those
  written before the run's first attempt started (an earlier run's, ``attempt_record.py``), skips those a
  kill cut short with a line each saying why, and every rank loads the one rank 0 chose;
- one line says which attempt this is, which file it resumes from and at which step, or that
  no checkpoint was usable and training starts from scratch.

It acts from inside Lightning's ``_CheckpointConnector.resume_start`` on this trainer only
(Lightning has no hook between its choice of the path and the load), when every rank has its
process group and the ``ModelCheckpoint`` folders are known.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sys
from typing import TYPE_CHECKING, Any, Protocol

import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_mgpu._compat.lightning import checkpoint_connector, hpc_resume_path, loaded_checkpoint
from lightning_mgpu.strategies.resume.attempt_record import AttemptRecord, checkpoint_folders, fingerprint
from lightning_mgpu.strategies.resume.candidates import Choice, find_checkpoints, newest_complete, set_aside
from lightning_mgpu.strategies.resume.restart import Restart, restart_of

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["AutoResume", "ResumeHost", "check_resume"]

log = logging.getLogger(__name__)


class ResumeHost(Protocol):
    """What ``AutoResume`` needs of its strategy."""

    strategy_name: str

    @property
    def global_rank(self) -> int: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...


def check_resume(resume: object) -> bool | None:
    """``resume`` as given, or ``ValueError`` naming what is accepted."""
    if resume is not None and not isinstance(resume, bool):
        raise ValueError(
            f"resume must be True (resume from the newest complete checkpoint), False (never) or None"
            f" (only when the run is a restart), got {resume!r}"
        )
    return resume


class AutoResume:
    """Chooses, on a restart, the checkpoint a ``fit`` without ``ckpt_path`` resumes from.

    Args:
        host: The strategy (its rank and broadcast).
        resume: ``None``: only when the run is a restart; ``True``: always, from the newest
            complete checkpoint if there is one; ``False``: never.
    """

    def __init__(self, host: ResumeHost, resume: bool | None) -> None:
        self.host = host
        self.resume = resume
        self.record = AttemptRecord()

    def install(self, trainer: pl.Trainer) -> None:
        """Take part in this trainer's choice of the checkpoint (once per trainer)."""
        connector = checkpoint_connector(trainer)
        if self.resume is False or "resume_start" in vars(connector):
            return
        callbacks: list[Any] = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning
        if self.record not in callbacks:
            callbacks.append(self.record)
        original = connector.resume_start
        connector.resume_start = functools.partial(self._resume_start, trainer, original)

    def _resume_start(
        self,
        trainer: pl.Trainer,
        original: Any,
        checkpoint_path: Any = None,
        weights_only: bool | None = None,
    ) -> None:
        connector = checkpoint_connector(trainer)
        # weights_only came with Lightning 2.6; older releases call and take the path alone
        start = original if weights_only is None else functools.partial(original, weights_only=weights_only)
        # Lightning's own choice under SLURM is the newest hpc_ckpt, complete or not: ours to make
        given = checkpoint_path is not None and str(checkpoint_path) != str(hpc_resume_path(connector))
        if trainer.state.fn != TrainerFn.FITTING or given:
            return start(checkpoint_path)
        restart = self._agreed_restart(trainer)
        name = self.host.strategy_name
        if not (self.resume or restart.is_restart):
            if self.record.left_by_this_process:
                rank_zero_info(
                    f"{name}: an earlier fit in this process did not finish ({self.record.path}); this fit"
                    " starts afresh: to go on from that fit's checkpoints, pass fit(ckpt_path=...) or use"
                    " resume=True"
                )
            return start(checkpoint_path)
        # resume=True takes what the folders hold; a restart, only what this run wrote
        since = None if self.resume else self.record.started_ns
        choice = self.host.broadcast(self._choose(trainer, since) if self.host.global_rank == 0 else None)
        if choice.earlier_runs:
            rank_zero_info(
                f"{name}: not resuming from {len(choice.earlier_runs)} checkpoint(s) written before this"
                f" run's first attempt started, an earlier run's (the newest: {choice.earlier_runs[0]});"
                " to go on from one of them, pass it as fit(ckpt_path=...) or use resume=True"
            )
        for skipped in choice.skipped:
            moved = f"; moved aside to {skipped.moved_to}" if skipped.moved_to else ""
            rank_zero_info(f"{name}: not resuming from {skipped.path}: {skipped.reason}{moved}")
        why = restart.describe() if restart.is_restart else "resume=True"
        if choice.path is None:
            folders = ", ".join(choice.searched) or "no checkpoint folder"
            rank_zero_info(
                f"{name}: {why}: no complete checkpoint in {folders}; training starts from scratch"
            )
            return start(None)
        start(choice.path)
        loaded = loaded_checkpoint(connector)
        rank_zero_info(
            f"{name}: {why}: resuming from {choice.path}, saved at global step"
            f" {loaded.get('global_step', '?')} (epoch {loaded.get('epoch', '?')})"
        )

    def _agreed_restart(self, trainer: pl.Trainer) -> Restart:
        """This run's :class:`Restart`: the largest count of any rank (torchrun counts per node), or rank
        0's record of an unfinished earlier attempt of this run (which rank 0 then records as running)."""
        own = restart_of(os.environ)
        folder = AttemptRecord.folder_of(trainer) if self.host.global_rank == 0 else None
        run = None
        if folder is not None:
            run = fingerprint(sys.argv, trainer.lightning_module)
            earlier = self.record.earlier_attempts(folder, run)
            if earlier > own.count:
                own = Restart(earlier, own.by, found_in=str(folder))
        every: list[Restart] = [own]
        if dist.is_initialized():
            every = [own] * dist.get_world_size()
            dist.all_gather_object(every, own)
        agreed = max(every, key=lambda restart: restart.count)  # the lowest rank's words on a tie
        if run is not None:  # rank 0, once the count is agreed: another node's restart is this run's too
            self.record.start(run, attempt=agreed.count)
        return agreed

    def _choose(self, trainer: pl.Trainer, since_ns: int | None) -> Choice:
        """Rank 0's choice; ``since_ns``: only checkpoints written since (a restart's first attempt)."""
        folders = checkpoint_folders(trainer)
        hpc = str(trainer.default_root_dir)
        searched = tuple(dict.fromkeys([*folders, hpc]))
        choice = newest_complete(find_checkpoints(folders, hpc), searched, since_ns)
        return dataclasses.replace(choice, skipped=tuple(set_aside(s) for s in choice.skipped))
