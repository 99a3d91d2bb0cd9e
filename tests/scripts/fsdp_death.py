"""A 2-process ``mgpu_fsdp`` fit whose rank 1 is SIGKILLed at its fourth batch (fsdp/test_fsdp.py).

Rank 1 dies in the middle of training, between FSDP's gathers and reduce-scatters (two linear layers:
units of their own besides the root), after writing its pid to ``victim_pid``.
"""

from __future__ import annotations

import os
import signal

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mgpu  # noqa: F401  registers mgpu_fsdp
from tests.models import quiet_trainer


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if batch_idx == 3 and self.global_rank == 1:
            with open("victim_pid", "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


trainer = quiet_trainer(
    devices=2,
    strategy="mgpu_fsdp",
    max_epochs=1,
)
trainer.fit(Regression(), DataLoader(TensorDataset(torch.randn(256, 4), torch.randn(256, 1)), batch_size=4))
