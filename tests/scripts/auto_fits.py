"""``mgpu_auto`` in one launch of two processes (tests/strategies/auto/test_strategy.py).

Usage: ``python auto_fits.py CHECKPOINT DDP_WEIGHTS`` in the folder to write into. A checkpoint of
``mgpu_dp`` is resumed under the ``mgpu_ddp`` that ``mgpu_auto`` picks (rank 0 saves the weights to
DDP_WEIGHTS), then two fits of ``MGPUAutoStrategy(device_memory=...)`` see the model (the later Trainers
reuse the processes): with its optimizer state the model fits only sharded (``mgpu_fsdp``, ``1KiB``),
then whole (``mgpu_ddp``, ``2KiB``). Rank 0 saves each fit's final weights (``1KiB.pt``, ``2KiB.pt``);
every rank writes what it saw to ``auto_rank{N}.json``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import lightning as L
import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler

from lightning_mgpu import DeviceTimeMonitor
from lightning_mgpu.strategies.auto import MGPUAutoStrategy
from lightning_mgpu.strategies.ddp.strategy import MGPUDDPStrategy
from lightning_mgpu.strategies.fsdp.strategy import MGPUFSDPStrategy
from tests.strategies.dp._dp_models import QUIET, Regressor, regression_data


def time_monitors(trainer: L.Trainer) -> list[int]:
    return [c.flush_every_n_steps for c in trainer.callbacks if isinstance(c, DeviceTimeMonitor)]  # type: ignore[attr-defined]


model = Regressor()
# the user's own monitor: mgpu_auto adds none beside it
mine = DeviceTimeMonitor(flush_every_n_steps=3, summary_file=None)
trainer = L.Trainer(
    accelerator="cpu",
    devices=2,
    strategy="mgpu_auto",
    max_epochs=2,
    use_distributed_sampler=False,
    callbacks=[mine],
    **QUIET,
)
# 5 rows per process, every other row of the global batch of 10: together, the single-device batches
data = regression_data(rows=20)
sampler: DistributedSampler[Any] = DistributedSampler(
    data, num_replicas=trainer.world_size, rank=trainer.global_rank, shuffle=False
)
trainer.fit(model, DataLoader(data, batch_size=5, sampler=sampler), ckpt_path=sys.argv[1])
assert type(trainer.strategy) is MGPUDDPStrategy, type(trainer.strategy)
assert time_monitors(trainer) == [3], time_monitors(trainer)
if trainer.is_global_zero:
    torch.save(model.state_dict(), sys.argv[2])


def fit_auto(device_memory: str) -> dict[str, Any]:
    model = Regressor()
    strategy = MGPUAutoStrategy(device_memory=device_memory)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, **QUIET)
    trainer.fit(model, DataLoader(data, batch_size=5))
    first = model.get_submodule("net.0")
    assert isinstance(first, torch.nn.Linear)
    weight = first.weight
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    final = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    if trainer.is_global_zero:
        torch.save(final, f"{device_memory}.pt")
    return {
        "strategy": type(trainer.strategy).__name__,
        "is_fsdp": isinstance(trainer.strategy, MGPUFSDPStrategy),
        "dtensors": sorted({type(p).__name__ for p in model.parameters()}),
        "rows": [local.shape[0], weight.shape[0]],
        "time_monitors": time_monitors(trainer),  # the one mgpu_auto added
    }


with open(f"auto_rank{trainer.global_rank}.json", "w") as f:
    json.dump({"1KiB": fit_auto("1KiB"), "2KiB": fit_auto("2KiB")}, f)
