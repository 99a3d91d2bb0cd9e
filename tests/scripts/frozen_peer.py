"""A 2-process ``mgpu_ddp`` run whose rank 1 gets no CPU while rank 0, which holds the store, leaves.

Usage: ``python frozen_peer.py FAULT SECONDS`` in a scratch folder (tests/strategies/process_group/
watchdog/test_held_store.py). Just before it leaves, rank 0 stops rank 1 with SIGSTOP and starts a
process that resumes it SECONDS later, as a loaded machine that schedules rank 1 late does. FAULT:
``raise`` (rank 0 fails at its third batch) or ``more`` (rank 1 has two batches more than rank 0, which
finishes the run).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lightning_mgpu import MGPUDDPStrategy
from lightning_mgpu._compat.lightning import SubprocessScriptLauncher
from tests.models import Regression, quiet_trainer

fault, seconds = sys.argv[1], float(sys.argv[2])


def freeze_rank1(trainer: L.Trainer) -> None:
    launcher = trainer.strategy.launcher
    assert isinstance(launcher, SubprocessScriptLauncher)
    pid = launcher.procs[0].pid
    os.kill(pid, signal.SIGSTOP)
    resume = f"import os, time; time.sleep({seconds}); os.kill({pid}, {int(signal.SIGCONT)})"
    subprocess.Popen([sys.executable, "-c", resume])


class LeavingRank0(Regression):
    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if fault == "raise" and self.global_rank == 0 and batch_idx == 2:
            freeze_rank1(self.trainer)
            raise RuntimeError("a bad sample on rank 0")
        return super().training_step(batch, batch_idx)

    def on_train_end(self) -> None:
        if fault == "more" and self.global_rank == 0:
            freeze_rank1(self.trainer)


class Shard(IterableDataset):
    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        batches = 8 if int(os.environ.get("LOCAL_RANK", 0)) == 1 else 6
        return iter(TensorDataset(torch.randn(4 * batches, 4), torch.randn(4 * batches, 1)))


trainer = quiet_trainer(
    devices=2,
    strategy=MGPUDDPStrategy(stall_timeout=300),
    max_epochs=1,
)
data = Shard() if fault == "more" else TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
trainer.fit(LeavingRank0(), DataLoader(data, batch_size=4))
