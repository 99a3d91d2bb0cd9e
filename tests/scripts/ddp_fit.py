"""Tiny regression fits on ``mgpu_ddp`` (tests/strategies/ddp/test_ddp.py).

Usage: ``python ddp_fit.py DEVICES NUM_NODES [unused]`` in a scratch folder. Rank 0 saves the data, the
initial and the final weights (``result.pt``), so the test can train the single-process reference on
the same global batches; each rank writes what it saw under ``shuffle=True`` and the threads left after
the fits. With ``unused``, a last fit in which every rank fails the same way.
"""

from __future__ import annotations

import sys
import threading

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mgpu  # noqa: F401  registers mgpu_ddp
from tests.models import quiet_trainer

devices, num_nodes = int(sys.argv[1]), int(sys.argv[2])


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.seen: list[list[float]] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.seen.append(x[:, 0].tolist())
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def trainer(max_epochs: int | None = None, max_steps: int = -1) -> L.Trainer:
    return quiet_trainer(
        devices=devices,
        num_nodes=num_nodes,
        strategy="mgpu_ddp",
        max_epochs=max_epochs,
        max_steps=max_steps,
    )


torch.manual_seed(0)
x, y = torch.randn(64, 4), torch.randn(64, 1)
model = Regression()
initial = {k: v.clone() for k, v in model.state_dict().items()}
fit = trainer(max_epochs=2)
fit.fit(model, DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False))
if fit.is_global_zero:
    torch.save({"x": x, "y": y, "initial": initial, "final": model.state_dict()}, "result.pt")

# the user's shuffle=True still shuffles
x[:, 0] = torch.arange(64.0)
model = Regression()
fit = trainer(max_steps=2)
fit.fit(model, DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True))
# one file per rank: two processes printing to one pipe can interleave their lines
with open(f"shuffled_rank{fit.global_rank}.txt", "w") as f:
    f.write(str(model.seen))
# nothing started for the runs outlives them
with open(f"threads_rank{fit.global_rank}.txt", "w") as f:
    f.write("\n".join(t.name for t in threading.enumerate()))


class Unused(Regression):
    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(4, 1)


if sys.argv[3:] == ["unused"]:  # a last fit in which every rank fails the same way
    trainer(max_steps=3).fit(Unused(), DataLoader(TensorDataset(x, y), batch_size=4))
