"""FSDP's own buffers out of memory under ``mgpu_fsdp``, on two processes (fsdp/test_buffers.py).

Two fits in one launch, run with LIMITED_MEMORY's environment. Rank 0's address space is limited right
before the unit ``wide`` runs its first forward, with room for 2 MiB (the all-gather buffer does not
fit: the batch runs again in micro-batches; each rank writes the rows it ran, rank 0 the weights), then
6 MiB (gloo's copy inside the all-gather does not fit: every rank stops).
"""

from __future__ import annotations

import json
import resource
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import MGPUFSDPStrategy
from tests.models import quiet_trainer


def squeeze(room_mib: int | None) -> None:
    # the address space this process holds now, plus room_mib; None lifts the limit
    with open("/proc/self/status") as status:
        held = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (hard if room_mib is None else held + room_mib * 2**20, hard))


class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.mid, self.down = nn.Linear(16, 1024), nn.Linear(1024, 1024), nn.Linear(1024, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.mid(torch.tanh(self.up(h)))))


class Model(L.LightningModule):
    def __init__(self, room_mib: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.wide, self.head = nn.Linear(4, 16), Wide(), nn.Linear(16, 1)
        self.room_mib, self.forwards = room_mib, 0
        self.rows: list[int] = []

    def on_train_start(self) -> None:
        if self.global_rank == 0:  # before FSDP's own hook, which allocates and gathers
            self.wide.register_forward_pre_hook(self.limit, prepend=True)

    def limit(self, module: nn.Module, args: Any) -> None:
        self.forwards += 1
        squeeze(self.room_mib if self.forwards == 1 else None)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.rows.append(len(x))
        # what the pass held when the all-gather buffer found no room: freed with the failed attempt
        held = torch.ones(4 * 2**20) if self.global_rank == 0 and self.forwards == 0 else None  # noqa: F841
        return F.mse_loss(self.head(self.wide(torch.tanh(self.lin(x)))), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def fit(room_mib: int) -> tuple[L.Trainer, Model]:
    model = Model(room_mib)
    strategy = MGPUFSDPStrategy(block_classes=["Wide"], micro_batch_size="auto")
    trainer = quiet_trainer(
        devices=2,
        strategy=strategy,
        max_steps=2,
    )
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=16))
    return trainer, model


g = torch.Generator().manual_seed(2)
x, y = torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)
trainer, model = fit(2)
final = {k: v.full_tensor() for k, v in model.state_dict().items()}  # a collective: every rank
with open(f"rows_rank{trainer.global_rank}.json", "w") as f:
    json.dump(model.rows, f)
if trainer.global_rank == 0:
    torch.save(final, "recovered.pt")
fit(6)
