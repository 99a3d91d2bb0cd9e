"""The training script of the SLURM tests (tests/slurm/jobs.py), run under ``srun`` as the job's tasks.

``python slurm_train.py STRATEGY MODE``: ``tests/strategies/ddp/test_ddp.py``'s regression fit (same
data, model, optimizer, two epochs of 8 global batches), so its weights are checked against the same
single-process reference.

- ``fit``: train, then each rank writes what SLURM told it and what Lightning made of it
  (``rank{N}.json``);
- ``kill``: rank 1 writes its pid to ``victim.pid`` and waits at batch 5 for the test to kill it.
"""

from __future__ import annotations

import json
import os
import sys
import time

import lightning as L
import torch
from lightning.pytorch.strategies import ParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mgpu  # noqa: F401  registers the mgpu_* strategies
from tests.models import quiet_trainer

strategy, mode = sys.argv[1], sys.argv[2]


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if mode == "kill" and batch_idx == 5 and self.global_rank == 1:
            with open("victim.pid", "w") as f:
                f.write(str(os.getpid()))
            while True:
                time.sleep(0.1)
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


torch.manual_seed(0)
x, y = torch.randn(64, 4), torch.randn(64, 1)  # the data reference_weights trains on
model = Regression()
initial = {k: v.clone() for k, v in model.state_dict().items()}
nodes = int(os.environ["SLURM_NNODES"])
tasks = int(os.environ.get("SLURM_NTASKS_PER_NODE", os.environ["SLURM_NTASKS"]))
trainer = quiet_trainer(
    devices=tasks,
    num_nodes=nodes,
    strategy=strategy,
    max_epochs=2,
)
trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False))
final = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
if trainer.is_global_zero:
    torch.save({"x": x, "y": y, "initial": initial, "final": final}, "result.pt")
assert isinstance(trainer.strategy, ParallelStrategy)
environment = trainer.strategy.cluster_environment
with open(f"rank{trainer.global_rank}.json", "w") as f:
    seen = {
        "slurm": {k: os.environ[k] for k in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_JOB_ID")},
        "global_rank": trainer.global_rank,
        "local_rank": trainer.local_rank,
        "world_size": trainer.world_size,
        "environment": type(environment).__name__,
        "strategy": type(trainer.strategy).__name__,
    }
    json.dump(seen, f)
