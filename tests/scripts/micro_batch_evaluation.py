"""Evaluation in micro-batches under ``mgpu_ddp``, on two processes (microbatch/test_evaluation.py).

Rank 1's validation (forward only: 2 row-sizes per row) fits 4 rows, not 8; its training has no limit.
Each rank writes what two fits logged and saw (``fits_rank{N}.json``: one unsplit, one with
``micro_batch_size="auto"``), then what ``trainer.predict`` returned over 17 rows (``predict_rank{N}.pt``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from lightning_mgpu import DeviceMemoryMonitor, MGPUDDPStrategy
from tests.strategies.microbatch._models import QUIET, Hungry, loader, regression_data


class Logged(Callback):
    # what each validation run logged, the sanity check's included (Lightning resets it after)
    def __init__(self) -> None:
        self.runs: list[dict[str, float]] = []

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.runs.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val")})


def trainer(callbacks: Sequence[Callback] = (), **strategy: Any) -> tuple[L.Trainer, MGPUDDPStrategy]:
    ddp = MGPUDDPStrategy(**strategy)
    quiet: dict[str, Any] = QUIET  # bools, which mypy does not match to each keyword's own type
    fit = L.Trainer(
        accelerator="cpu", devices=2, strategy=ddp, max_steps=2, callbacks=list(callbacks), **quiet
    )
    return fit, ddp


# rank 1's validation (forward only: 2 row-sizes per row) fits 4 rows, not 8; its training has no limit
fits = {}
for name, micro, limit in (("whole", None, None), ("auto", "auto", 1)):
    logged = Logged()
    callbacks = [logged, DeviceMemoryMonitor(every_n_steps=1)] if micro else [logged]
    fit, strategy = trainer(callbacks, micro_batch_size=micro)
    model = Hungry(limit_rank=limit, budget=12, limit_in="eval")
    fit.fit(model, loader(regression_data(), 8), loader(regression_data(32, seed=3), 8))
    validation = strategy.micro_batches_eval["validation_step"]
    fits[name] = {
        "logged": logged.runs,
        "seen": {"train": model.sizes_seen, "eval": model.eval_sizes_seen},
        "sizes": {
            "train": strategy.micro_batches.size,
            "train_last": strategy.micro_batches.last_rows,
            "eval": validation.size,
            "eval_failed": validation.failed,
            "eval_last": validation.last_rows,
        },
    }
with open(f"fits_rank{fit.global_rank}.json", "w") as f:
    json.dump(fits, f)

# predict: 17 rows, 9 on rank 0 (batches of 8 and 1), 8 on rank 1 (one batch, which fails whole)
predict, strategy = trainer(micro_batch_size="auto")
model = Hungry(limit_rank=1, budget=12, limit_in="eval")
predictions = predict.predict(model, loader(regression_data(17, seed=4), 8))
sizes = strategy.micro_batches_eval["predict_step"]
torch.save(
    {
        "predictions": predictions,
        "seen": model.eval_sizes_seen,
        "size": sizes.size,
        "validation": strategy.micro_batches_eval["validation_step"].size,
        "train": strategy.micro_batches.size,
    },
    f"predict_rank{predict.global_rank}.pt",
)
