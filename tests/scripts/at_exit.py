"""A 2-process fit that writes, at its last ``atexit`` handler, whether a process group or thread is left.

Usage: ``python at_exit.py STRATEGY [FAULT]`` in a scratch folder (tests/strategies/process_group/
test_at_exit.py). Each rank writes ``exit_rank{N}.txt``. FAULT: ``raise`` (rank 1 fails at its third
batch) or ``slow-exit`` (the same, and rank 0 goes on exiting once its watchdog began to stop it,
its stderr in ``rank0.err``).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import lightning_mgpu  # noqa: F401  registers the strategies
from tests.models import Regression, quiet_trainer


def report() -> None:
    alive = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
    with open(f"exit_rank{os.environ.get('LOCAL_RANK', '0')}.txt", "w") as f:
        f.write(f"group alive: {dist.is_available() and dist.is_initialized()}, threads: {alive}")


# registered before Lightning and the strategy start, the report runs after their exit handlers
atexit.register(report)

fault = sys.argv[2] if len(sys.argv) > 2 else "none"


class FailingOnRank1(Regression):
    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if fault != "none" and self.global_rank == 1 and batch_idx == 2:
            raise RuntimeError("a bad sample on rank 1")
        return super().training_step(batch, batch_idx)


class SlowExit(L.Callback):
    # rank 0 writes its stderr to a file and, once its watchdog began to stop it, goes on exiting (the
    # strategy's own line comes after the callbacks' on_exception: the line seen here is the watchdog's)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.global_rank == 0:  # the child ranks have started: they keep the inherited stderr
            os.dup2(os.open("rank0.err", os.O_WRONLY | os.O_CREAT, 0o644), 2)

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        while trainer.global_rank == 0 and "[rank 0] " not in Path("rank0.err").read_text():
            time.sleep(0.1)


trainer = quiet_trainer(
    devices=2,
    strategy=sys.argv[1],
    max_epochs=1,
    callbacks=[SlowExit()] if fault == "slow-exit" else [],
)
trainer.fit(FailingOnRank1(), DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=4))
