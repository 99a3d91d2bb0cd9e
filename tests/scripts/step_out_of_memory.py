"""A 2-process ``mgpu_ddp`` fit whose rank 0 runs out of memory in its first optimizer step.

Rank 0 can hold its parameters, gradients and the batch, but not AdamW's two moments of its 4 MiB
weight: its address space is limited right before the step
(tests/strategies/process_group/test_step_memory.py; run with LIMITED_MEMORY's environment).
"""

from __future__ import annotations

import resource

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mgpu  # noqa: F401  registers mgpu_ddp
from tests.models import quiet_trainer


class Wide(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.global_rank == 0 and self.trainer.global_step == 0:
            with open("/proc/self/status") as status:
                held = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
            _, hard = resource.getrlimit(resource.RLIMIT_AS)
            resource.setrlimit(resource.RLIMIT_AS, (held + 3 * 2**20, hard))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


trainer = quiet_trainer(
    devices=2,
    strategy="mgpu_ddp",
    max_steps=4,
)
data = TensorDataset(torch.randn(64, 1024), torch.randn(64, 1))
trainer.fit(Wide(), DataLoader(data, batch_size=4))
