"""Micro-batching and ``global_mean`` on two ``mgpu_ddp`` ranks (tests/strategies/microbatch/test_ddp.py).

One launch runs every fit: ``global_mean`` losses and fixed micro-batches (``losses_rank{N}.json``),
a real out-of-memory in backward on rank 1 only (``sizes_rank{N}.json``), the gradient average itself
(rank 0 saves the weights and averages to ``ddp.pt``), and last a batch that does not fit even in
micro-batches of one row on rank 1, which must end both ranks. Run with LIMITED_MEMORY's environment.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import TensorDataset

from lightning_mgpu import DeviceMemoryMonitor, MGPUDDPStrategy
from lightning_mgpu.strategies.microbatch.grads import average_over_ranks
from tests.strategies.microbatch._models import (
    QUIET,
    Hungry,
    LoggedTokenModel,
    LossRecorder,
    loader,
    regression_data,
    token_data,
)


def fit(
    model: L.LightningModule,
    data: TensorDataset,
    batch_size: int,
    steps: int,
    callbacks: Sequence[Callback] = (),
    **strategy: Any,
) -> tuple[L.Trainer, MGPUDDPStrategy]:
    ddp = MGPUDDPStrategy(**strategy)
    quiet: dict[str, Any] = QUIET  # bools, which mypy does not match to each keyword's own type
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=ddp, max_steps=steps, callbacks=list(callbacks), **quiet
    )
    trainer.fit(model, loader(data, batch_size))
    return trainer, ddp


results: dict[str, Any] = {}
losses = {}
for kind in ("masked", "sum", "naive"):  # global_mean, 8 rows per rank
    model, recorder = LoggedTokenModel(kind), LossRecorder()
    trainer, _ = fit(model, token_data(), 8, 2, [recorder])
    results[kind] = model.state_dict()
    losses[kind] = recorder.losses()
for kind in ("masked", "mean"):  # and in micro-batches of at most 3 rows
    model, recorder = LoggedTokenModel(kind), LossRecorder()
    trainer, _ = fit(model, token_data(), 8, 2, [recorder], micro_batch_size=3)
    results["micro_" + kind] = model.state_dict()
    losses["micro_" + kind] = recorder.losses()
with open(f"losses_rank{trainer.global_rank}.json", "w") as f:
    json.dump(losses, f)

# rank 1 runs out of memory in backward with its whole batch of 8 rows; the monitor's table shows the sizes
hungry = Hungry(limit_rank=1, budget=24)
monitor = DeviceMemoryMonitor(every_n_steps=1)
trainer, strategy = fit(hungry, regression_data(), 8, 2, [monitor], micro_batch_size="auto")
results["oom"] = hungry.state_dict()
with open(f"sizes_rank{trainer.global_rank}.json", "w") as f:
    json.dump({"final": strategy.micro_batches.size, "seen": hungry.sizes_seen}, f)
# the gradient average itself: a large tensor reduced in place, a small one and a strided one in a bucket
factor = trainer.global_rank + 1.0
strided = torch.arange(6.0).reshape(2, 3).t() * factor
grads = [torch.full((300_000,), factor), torch.full((3,), 10 * factor), strided]
average_over_ranks(grads, 2)
results["averaged"] = grads
if trainer.is_global_zero:
    torch.save(results, "ddp.pt")

# rank 1 cannot hold the activations of one row: both ranks must stop
print(f"rank {trainer.global_rank} starts the fit that cannot fit at {time.time()}", flush=True)
fit(Hungry(limit_rank=1, budget=32, forward_extra=40), regression_data(), 8, 2, micro_batch_size="auto")
