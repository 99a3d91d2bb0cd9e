"""Three ``mgpu_fsdp`` fits of a fresh model in one launch of two processes, then one more of the first model.

Usage: ``python fsdp_open_files.py`` in a scratch folder (tests/strategies/fsdp/test_mesh.py). After each
fit every rank prints one ``OUTSIDE {json}`` line with its open files; rank 0 saves the fit's final weights
(``fit{N}.pt``). Each fit starts from the same weights and data, so the three must end equal.
"""

from __future__ import annotations

import json
import os
import sys

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import MGPUFSDPStrategy
from tests.models import quiet_trainer

RANK = int(os.environ.get("LOCAL_RANK", 0))


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(model: Regression, name: str) -> None:
    trainer = quiet_trainer(
        devices=2,
        strategy=MGPUFSDPStrategy(),
        max_epochs=2,
    )
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 6, generator=generator), torch.randn(32, 2, generator=generator))
    trainer.fit(model, DataLoader(data, batch_size=4))
    weights = {key: value.full_tensor() for key, value in model.state_dict().items()}  # every rank gathers
    if RANK == 0:
        torch.save(weights, f"{name}.pt")
    outside = {"fit": name, "rank": RANK, "open_files": len(os.listdir("/proc/self/fd"))}
    # one write: the two ranks share the pipe, and a line written in pieces may interleave
    sys.stdout.write(f"OUTSIDE {json.dumps(outside)}\n")
    sys.stdout.flush()


def fresh() -> Regression:
    torch.manual_seed(RANK)  # a different init on each rank: the strategy starts both from rank 0's
    return Regression()


first = fresh()
fit(first, "fit1")
fit(fresh(), "fit2")
fit(fresh(), "fit3")
fit(first, "again")  # sharded by the first fit, over that fit's device mesh
