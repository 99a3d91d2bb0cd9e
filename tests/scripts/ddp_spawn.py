"""``mgpu_ddp`` with ``start_method="spawn"`` (tests/strategies/ddp/test_ddp.py).

A fit longer than a missing heartbeat takes to be noticed, each rank writing the rank its watchdog
watches under (``rank{N}.txt``); then a fit with an unused parameter, whose error the launching
process writes to ``unused.txt``.
"""

from __future__ import annotations

import time

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import MGPUDDPStrategy
from lightning_mgpu.strategies.process_group.watchdog.watchdog import DEAD_AFTER, watchdog
from tests.models import Regression, quiet_trainer


class Slow(Regression):
    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if batch_idx == 0:
            with open(f"rank{self.global_rank}.txt", "w") as f:
                f.write(str(watchdog().rank))
        time.sleep(0.1)
        return super().training_step(batch, batch_idx)


class Unused(Regression):
    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(4, 1)  # never reaches the loss


def trainer(max_steps: int) -> L.Trainer:
    strategy = MGPUDDPStrategy(start_method="spawn")
    return quiet_trainer(
        devices=2,
        strategy=strategy,
        max_steps=max_steps,
    )


if __name__ == "__main__":
    steps = int((DEAD_AFTER + 4) / 0.1)  # longer than a missing heartbeat takes to be noticed
    loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=2)
    trainer(max_steps=steps).fit(Slow(), loader)

    # the launching process holds an unwrapped model: the ranks must name the unused parameters
    try:
        trainer(max_steps=3).fit(Unused(), loader)
    except Exception as error:
        with open("unused.txt", "w") as f:
            f.write(f"{type(error).__name__}: {error}")
