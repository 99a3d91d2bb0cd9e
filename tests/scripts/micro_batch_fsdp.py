"""Micro-batching on two ``mgpu_fsdp`` ranks, real allocation failures between FSDP's gathers.

tests/strategies/microbatch/test_fsdp.py runs it with LIMITED_MEMORY's environment: ``global_mean``
losses whole and in fixed micro-batches (``losses_rank{N}.json``), out-of-memory on rank 1 in forward,
backward, recomputation and at the second step (``sizes_rank{N}.json``), a validation that runs out
inside a block (``validated_rank{N}.json``); rank 0 saves the full weights to ``fsdp.pt``. Last, a batch
that does not fit even in micro-batches of one row on rank 1, which must end both ranks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import TensorDataset

from lightning_mgpu import DeviceMemoryMonitor, MGPUFSDPStrategy
from tests.strategies.microbatch._models import (
    QUIET,
    HungryBlocks,
    LoggedTokenModel,
    LossRecorder,
    TokenModel,
    loader,
    regression_data,
    token_data,
)

quiet: dict[str, Any] = QUIET  # bools, which mypy does not match to each keyword's own type


def fit(
    model: L.LightningModule,
    data: TensorDataset,
    batch_size: int,
    steps: int,
    accumulate: int = 1,
    callbacks: Sequence[Callback] = (),
    **strategy: Any,
) -> tuple[L.Trainer, MGPUFSDPStrategy]:
    fsdp = MGPUFSDPStrategy(**strategy)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=fsdp,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        callbacks=list(callbacks),
        **quiet,
    )
    trainer.fit(model, loader(data, batch_size))
    return trainer, fsdp


def full(model: L.LightningModule) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


results, losses = {}, {}
for kind, micro in (("masked", None), ("masked", 3), ("sum", 3)):  # global_mean; 8 rows per rank
    logged, recorder = LoggedTokenModel(kind), LossRecorder()
    trainer, _ = fit(logged, token_data(), 8, 2, callbacks=[recorder], micro_batch_size=micro)
    results[f"{kind}_{micro}"] = full(logged)
    losses[f"{kind}_{micro}"] = recorder.losses()
with open(f"losses_rank{trainer.global_rank}.json", "w") as f:
    json.dump(losses, f)
for micro in (None, 3):  # two batches of 4 rows per rank accumulated into each step
    tokens = TokenModel("mean")
    trainer, _ = fit(tokens, token_data(), 4, 2, accumulate=2, micro_batch_size=micro)
    results[f"accumulated_{micro}"] = full(tokens)

sizes = {}
# rank 1 fails with its whole batch of 8 rows; "recompute": in backward, recomputing a checkpointed block
for phase, budget, recompute in [("forward", 24, False), ("backward", 32, False), ("recompute", 24, True)]:
    model = HungryBlocks(limit_rank=1, budget=budget)
    # the memory summary of the first: rank 0 ran micro-batches too, as many as rank 1
    monitor = [DeviceMemoryMonitor(every_n_steps=1)] if phase == "forward" else []
    trainer, strategy = fit(
        model,
        regression_data(),
        8,
        2,
        callbacks=monitor,
        micro_batch_size="auto",
        activation_checkpointing=recompute,
    )
    results[phase] = full(model)
    sizes[phase] = {"final": strategy.micro_batches.size, "seen": model.sizes_seen}
# the same at the second step, whose collectives the first taught: nobody announces them
for phase, budget in [("later_forward", 24), ("later_backward", 32)]:
    model = HungryBlocks(limit_rank=1, budget=budget, limit_from=1)
    model._lift()  # the limit the fit before set on rank 1 stays until a new one is set
    trainer, strategy = fit(model, regression_data(), 8, 2, micro_batch_size="auto")
    results[phase] = full(model)
    sizes[phase] = {"final": strategy.micro_batches.size, "seen": model.sizes_seen}
with open(f"sizes_rank{trainer.global_rank}.json", "w") as f:
    json.dump(sizes, f)
# validation: rank 1 fits 4 rows, not 8 (forward only: 2 row-sizes per row), and fails inside a block
validated = {}
for micro_eval, limit in ((None, None), ("auto", 1)):
    model = HungryBlocks(limit_rank=limit, budget=12, limit_in="eval")
    strategy = MGPUFSDPStrategy(micro_batch_size=micro_eval)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, **quiet)
    metrics = trainer.validate(model, loader(regression_data(), 8), verbose=False)[0]
    validated[str(micro_eval)] = {"metrics": metrics, "seen": model.eval_sizes_seen}
with open(f"validated_rank{trainer.global_rank}.json", "w") as f:
    json.dump(validated, f)
if trainer.is_global_zero:
    torch.save(results, "fsdp.pt")

# rank 1 cannot hold the activations of one row: both ranks must stop
fit(HungryBlocks(limit_rank=1, budget=32, forward_extra=40), regression_data(), 8, 2, micro_batch_size="auto")
