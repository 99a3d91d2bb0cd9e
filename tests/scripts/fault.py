"""A 2-process ``mgpu_ddp`` run in which one rank fails at batch 5 of 64 (tests/strategies/ddp/test_faults).

Usage: ``python fault.py VICTIM FAULT STALL_TIMEOUT`` in a scratch folder; the victim writes
``fault_at`` (time and pid) there just before its fault. FAULT is ``sigkill``, ``exit`` (os._exit),
``raise``, ``stall``, ``more`` (two batches more than the others) or ``end`` (fails after the last
collective); STALL_TIMEOUT is seconds or ``none``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lightning_mgpu import MGPUDDPStrategy
from tests.models import Regression, quiet_trainer

victim, fault = int(sys.argv[1]), sys.argv[2]
stall_timeout = None if sys.argv[3] == "none" else float(sys.argv[3])


def stall_forever() -> None:
    while True:
        time.sleep(0.1)


def write_fault_at() -> None:
    with open("fault_at", "w") as f:
        f.write(f"{time.time()} {os.getpid()}")


class Faulty(Regression):
    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if fault not in ("more", "end") and batch_idx == 5 and self.global_rank == victim:
            write_fault_at()
            if fault == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "exit":
                os._exit(7)
            if fault == "raise":
                raise RuntimeError("the database connection timed out")
            stall_forever()
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        if fault == "more" and batch_idx == 5 and self.global_rank == victim:  # the others' last batch
            write_fault_at()

    def on_train_end(self) -> None:
        if fault == "end" and self.global_rank == victim:
            write_fault_at()
            raise RuntimeError("saving the report failed")


class Shard(IterableDataset):
    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        batches = 8 if int(os.environ.get("LOCAL_RANK", 0)) == victim else 6
        return iter(TensorDataset(torch.randn(4 * batches, 4), torch.randn(4 * batches, 1)))


trainer = quiet_trainer(
    devices=2,
    strategy=MGPUDDPStrategy(stall_timeout=stall_timeout),
    max_epochs=1,
)
data = Shard() if fault == "more" else TensorDataset(torch.randn(256, 4), torch.randn(256, 1))
trainer.fit(Faulty(), DataLoader(data, batch_size=4))
