"""A 2-GPU fit of a wide model that writes the memory each rank holds after two steps.

Usage: ``python fsdp_memory_gpu.py STRATEGY`` (``mgpu_ddp`` or ``mgpu_fsdp``) in the folder to write
into (tests/strategies/fsdp/test_fsdp_gpu.py): each rank writes ``torch.cuda.memory_allocated()`` to
``{STRATEGY}_rank{N}.txt``.
"""

from __future__ import annotations

import sys
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mgpu  # noqa: F401  (registers the strategies)
from tests.models import quiet_trainer


class Wide(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(*(nn.Linear(2048, 2048) for _ in range(8)))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters())

    def on_train_batch_end(self, *args: Any) -> None:
        if self.trainer.global_step == 2:
            torch.cuda.synchronize()
            with open(f"{sys.argv[1]}_rank{self.global_rank}.txt", "w") as f:
                f.write(str(torch.cuda.memory_allocated()))


trainer = quiet_trainer(
    accelerator="gpu",
    devices=2,
    strategy=sys.argv[1],
    max_steps=3,
)
trainer.fit(Wide(), DataLoader(TensorDataset(torch.randn(48, 2048)), batch_size=8))
