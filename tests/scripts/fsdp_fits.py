"""Every fit of tests/strategies/fsdp/test_fsdp.py, in one launch of two ``mgpu_fsdp`` processes.

Lightning's launcher starts the second rank once and later Trainers reuse the process group. Each rank
builds its model from its own seed: the strategy must start both from rank 0's weights. Rank 0 saves
the data (``data.pt``), each fit's initial, sharded and final weights (``{name}.pt``); the AdamW fit
writes what each rank holds (``state_rank{N}.json``) and the memory summary; a one-epoch fit saves a
sharded checkpoint (``ckpt/``) the next one resumes from; a model held in one attribute saves twice
to ``wrapped/``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import DeviceMemoryMonitor, MGPUFSDPStrategy, PlainStateDictExport
from lightning_mgpu.estimate.model_state import measure_model_state
from tests.models import quiet_trainer

RANK = int(os.environ.get("LOCAL_RANK", 0))


class Regression(L.LightningModule):
    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.optimizer = optimizer
        self.net = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 33), nn.Tanh())
        self.head = nn.Linear(33, 2)  # held by the root unit, gathered around the step
        self.forward_dtypes: set[str] = set()
        self.net[2].register_forward_hook(lambda m, i, o: self.forward_dtypes.add(str(m.weight.dtype)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(x))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)


class Measure(Callback):
    # what this rank holds at the second optimizer step, when AdamW's state exists
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if trainer.global_step == 1:
            state = measure_model_state(pl_module, [optimizer])
            rows = sum(p.numel() // p.shape[0] * p.element_size() for p in pl_module.parameters())
            with open(f"state_rank{RANK}.json", "w") as f:
                json.dump({**asdict(state), "rows": rows}, f)


def fit(
    name: str,
    optimizer: str,
    precision: Any = "32-true",
    epochs: int = 2,
    callbacks: Sequence[Callback] = (),
    ckpt_path: str | None = None,
    **strategy: Any,
) -> None:
    torch.manual_seed(RANK)  # a different init on each rank
    model = Regression(optimizer)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = quiet_trainer(
        devices=2,
        strategy=MGPUFSDPStrategy(**strategy),
        max_epochs=epochs,
        precision=precision,
        enable_checkpointing=bool(callbacks),
        callbacks=list(callbacks),
    )
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False), ckpt_path=ckpt_path)
    sharded = {k: (type(v).__name__, str(v.dtype)) for k, v in model.state_dict().items()}
    final = {k: v.full_tensor() for k, v in model.state_dict().items()}  # a collective: every rank
    if RANK == 0:
        saved = {"initial": initial, "final": final, "sharded": sharded}
        torch.save({**saved, "forward_dtypes": sorted(model.forward_dtypes)}, f"{name}.pt")


class Wrapped(L.LightningModule):  # its layers in one attribute, as a model from a library is held
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 2))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.model(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


torch.manual_seed(1234)
x, y = torch.randn(64, 6), torch.randn(64, 2)
if RANK == 0:
    torch.save({"x": x, "y": y}, "data.pt")
fit("sgd", "sgd")
monitor = DeviceMemoryMonitor(every_n_steps=1, summary_file="adamw_memory.json")
fit("adamw", "adamw", callbacks=[Measure(), monitor])
fit("bf16", "sgd", precision="bf16-mixed")
# resume: one epoch saved as a sharded folder, then a second epoch from it
# (and the plain weights of the run and of its sharded checkpoint, as PlainStateDictExport writes them)
saving = [ModelCheckpoint(dirpath="ckpt", save_last=True), PlainStateDictExport()]
fit("first_epoch", "adamw", epochs=1, callbacks=saving)
fit("resumed", "adamw", ckpt_path="ckpt/last.ckpt", reshard_after_forward=False)

# last.ckpt saved at the end of each of two epochs, the second over the first; plain weights beside it
wrapped = Wrapped()
trainer = quiet_trainer(
    devices=2,
    strategy="mgpu_fsdp",
    max_epochs=2,
    enable_checkpointing=True,
    callbacks=[ModelCheckpoint(dirpath="wrapped", save_last=True), PlainStateDictExport()],
)
trainer.fit(wrapped, DataLoader(TensorDataset(x, y), batch_size=4))
final = {k: v.full_tensor() for k, v in wrapped.model.state_dict().items()}
if RANK == 0:
    torch.save(final, "wrapped.pt")
