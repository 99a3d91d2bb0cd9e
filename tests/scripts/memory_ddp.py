"""A 2-process ``mgpu_ddp`` fit watched by ``DeviceMemoryMonitor`` (tests/callbacks/test_memory_ddp.py).

Usage: ``python memory_ddp.py LOG_DIR MODE``, 8 batches of 4 rows per rank, a CSVLogger in LOG_DIR.
MODE is ``hoard`` (rank 0 keeps 400 MiB more than rank 1, logged every 2 steps; prints ``LOG_DIR <the
trainer's log_dir>``), ``windows`` (logged every step, gathered every 3, each rank logging its own
``rank_batch``; then a second fit, logged in LOG_DIR-again, each rank printing ``OPEN_FILES <rank> <n>``
after each fit) or ``oom`` (rank 1 raises ``MemoryError`` at batch 3; each rank writes ``rank <r> ended``
to stderr as it leaves).
"""

from __future__ import annotations

import os
import sys

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import DeviceMemoryMonitor
from tests.models import Regression, quiet_trainer

log_dir, mode = sys.argv[1], sys.argv[2]


class Hoarder(Regression):
    def on_train_start(self) -> None:
        if self.global_rank == 0:
            self.hoard = torch.ones(100 * 2**20)  # 400 MiB that only rank 0 keeps


class Logging(Regression):
    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.log("rank_batch", float(self.global_rank * 100 + batch_idx))
        return super().training_step(batch, batch_idx)


class OutOfMemory(Regression):
    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.global_rank == 1 and batch_idx == 3:
            raise MemoryError("could not allocate 3 GiB")
        return super().training_step(batch, batch_idx)


def trainer(every: int, flush: int = 25, logs: str = log_dir) -> L.Trainer:
    return quiet_trainer(
        devices=2,
        strategy="mgpu_ddp",
        max_epochs=1,
        logger=CSVLogger(logs),
        callbacks=[DeviceMemoryMonitor(every_n_steps=every, flush_every_n_steps=flush)],
        log_every_n_steps=every,
    )


data = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=4)
if mode == "hoard":
    t = trainer(every=2)
    t.fit(Hoarder(), data)
    print("LOG_DIR", t.log_dir)
elif mode == "windows":
    # 8 logs: gathers after batches 3 and 6, the rest at the end; a second fit shows what the first left
    for logs in (log_dir, log_dir + "-again"):
        t = trainer(every=1, flush=3, logs=logs)
        t.fit(Logging(), data)
        print(f"OPEN_FILES {t.global_rank} {len(os.listdir('/proc/self/fd'))}", flush=True)
else:
    t = trainer(every=1)
    try:
        t.fit(OutOfMemory(), data)
    finally:
        print(f"rank {t.global_rank} ended", file=sys.stderr, flush=True)
