"""A run started again by hand is a restart too: the record of its last attempt, in its checkpoint folder.

torchrun and SLURM count their restarts (``restart.py``). A job run again by hand (the same command
after a crash, a node lost with nothing to restart it) has no such count, but its checkpoint folder
tells: rank 0 keeps there, in :data:`RECORD_NAME`, the attempt that is running, and marks it finished
when its ``fit`` ends. A ``fit`` that finds the record of an unfinished attempt of the same run is
the next attempt of that run. The same run means the same command line and the same model (the
names, shapes and dtypes of its parameters and buffers): a script whose arguments or model changed
since, or a folder whose last run finished, starts afresh. So does a ``fit`` in the process that
left the unfinished record (a notebook cell run again, a retry loop): the record names its process
(host, pid and the process's start time, so that a new process given the same pid is told apart),
and only another process is evidence of a restart.

The record also keeps when the run's first attempt started (the record file's modification time, the
clock the checkpoints' own times come from): a restart resumes only from checkpoints written since,
never from those an earlier run left in the same folder.

The folder is the first ``ModelCheckpoint``'s: a fixed ``dirpath`` is found again by the next
attempt; Lightning's default (under the logger's new version folder) never is.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from typing_extensions import override

from lightning_mgpu._atomic import atomic_write

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["RECORD_NAME", "AttemptRecord", "checkpoint_folders", "fingerprint"]

log = logging.getLogger(__name__)

RECORD_NAME = ".lightning_mgpu_attempt.json"
_VERSION = 1


def fingerprint(argv: Sequence[str], module: nn.Module) -> str:
    """What makes two attempts one run: the command line; the names, shapes, dtypes of the model's tensors."""
    tensors = [
        (name, list(tensor.shape), str(tensor.dtype))
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]
    ]
    return hashlib.sha256(json.dumps([list(argv), tensors]).encode()).hexdigest()


def checkpoint_folders(trainer: pl.Trainer) -> list[str]:
    """The folders of the trainer's ``ModelCheckpoint`` callbacks that have one, in their order."""
    return [
        str(cb.dirpath)
        for cb in trainer.checkpoint_callbacks
        if isinstance(cb, ModelCheckpoint) and cb.dirpath
    ]


@functools.cache
def this_process() -> str:
    """This process, told apart from any other on any host: host name, pid and start time."""
    return f"{socket.gethostname()}:{os.getpid()}:{psutil.Process().create_time()}"


class AttemptRecord(Callback):
    """Rank 0's record of the run's attempts in its checkpoint folder (see the module).

    ``AutoResume`` reads it and starts the attempt; the callback marks it finished when ``fit`` ends.
    """

    def __init__(self) -> None:
        self.path: Path | None = None
        self._content: dict[str, Any] | None = None
        self._same_run: dict[str, Any] = {}
        self.left_by_this_process = False
        """Whether the last record read was an unfinished attempt of this very process (an earlier fit)."""

    @staticmethod
    def folder_of(trainer: pl.Trainer) -> Path | None:
        """The first ``ModelCheckpoint``'s folder; ``None`` without one, or where Lightning writes no
        checkpoint (``fast_dev_run``)."""
        folders = checkpoint_folders(trainer)
        # fast_dev_run: set by Lightning outside __init__
        return Path(folders[0]) if folders and not getattr(trainer, "fast_dev_run", False) else None

    def earlier_attempts(self, folder: Path, run: str) -> int:
        """How many attempts of ``run`` came before, the last unfinished; 0 when there is none such."""
        self.path, self._same_run, self.left_by_this_process = folder / RECORD_NAME, {}, False
        try:
            record = json.loads(self.path.read_text())
        except FileNotFoundError:
            return 0
        except (OSError, ValueError) as err:
            log.warning("%s cannot be read (%s): this attempt counts as a first one", self.path, err)
            return 0
        if not isinstance(record, dict) or record.get("version") != _VERSION or record.get("run") != run:
            log.debug("%s holds another run's attempt: %s", self.path, record)
            return 0
        self._same_run = record
        if record.get("finished") or not isinstance(record.get("attempt"), int):
            return 0
        if record.get("process") == this_process():
            self.left_by_this_process = True
            return 0
        return int(record["attempt"]) + 1

    def start(self, run: str, attempt: int) -> None:
        """Record attempt ``attempt`` (0 the first) of ``run`` as running.

        A later attempt keeps the start of the run's first attempt from the record it found; a first
        one, or one that found no record of its run, starts the run now.
        """
        if self.path is None:
            return
        content: dict[str, Any] = {
            "version": _VERSION,
            "run": run,
            "attempt": attempt,
            "finished": False,
            "process": this_process(),
        }
        started = self._same_run.get("started_ns") if attempt > 0 else None
        if isinstance(started, int):
            self._write({**content, "started_ns": started})
            return
        if not self._write(content):
            return
        with contextlib.suppress(OSError):  # now, by the clock of the folder's file system
            self._write({**content, "started_ns": self.path.stat().st_mtime_ns})

    @property
    def started_ns(self) -> int | None:
        """When the run's first attempt started (``st_mtime_ns``); ``None`` where the record is not kept."""
        started = (self._content or {}).get("started_ns")
        return started if isinstance(started, int) else None

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == 0 and self._content is not None:
            self._write({**self._content, "finished": True})

    def _write(self, content: dict[str, Any]) -> bool:
        assert self.path is not None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_write(self.path) as file:  # a kill while writing leaves the record it replaces
                file.write(json.dumps(content).encode())
        except OSError as err:
            log.warning(
                "cannot write %s (%s): a run started again by hand will not resume by itself", self.path, err
            )
            return False
        self._content = content
        return True
