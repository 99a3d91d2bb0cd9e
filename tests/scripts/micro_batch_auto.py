"""``micro_batch_size="auto"`` on one device under real out-of-memory errors (test_micro_batching.py).

Run with LIMITED_MEMORY's environment: the sizes tried in backward, forward, with a token mean, while
growing back and in validation go to ``seen.json``; the last fit never fits, and the run ends.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

from lightning_mgpu.strategies.dp.strategy import MGPUDataParallelStrategy
from tests.strategies.microbatch._models import QUIET, Hungry, LossRecorder, loader, regression_data

logging.basicConfig()
logging.getLogger("lightning_mgpu.strategies.microbatch").setLevel(logging.INFO)  # how the size grows
quiet: dict[str, Any] = QUIET  # bools, which mypy does not match to each keyword's own type


def fit(
    model: Hungry, batch_size: int, steps: int, grow_after: int = 100, callbacks: Sequence[Callback] = ()
) -> Hungry:
    strategy = MGPUDataParallelStrategy(micro_batch_size="auto")
    strategy.micro_batches.grow_after = grow_after
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, callbacks=list(callbacks), **quiet
    )
    trainer.fit(model, loader(regression_data(), batch_size))
    return model


seen: dict[str, Any] = {}
# backward needs about 4 row-sizes per row, forward 1 (+ forward_extra): 24 fit 4 rows, not 8
seen["backward"] = fit(Hungry(limit_rank=0, budget=24), 8, 2).sizes_seen
seen["forward"] = fit(Hungry(limit_rank=0, budget=32, forward_extra=5), 8, 2).sizes_seen
# a token mean: after the out-of-memory the micro-batches hold other counts than rows
recorder = LossRecorder()
seen["masked"] = fit(Hungry(limit_rank=0, budget=24, masked=True), 8, 2, callbacks=[recorder]).sizes_seen
seen["masked_losses"] = recorder.losses()
# 16 and 8 rows fail, 4 fit; the limit is lifted at step 1 and after 2 clean batches it grows to 6
model = fit(Hungry(limit_rank=0, budget=24, lift_at=1), 16, 4, grow_after=2)
seen["grow"] = model.sizes_seen
# validation, forward only (2 row-sizes per row), fits 4 rows, not 8
model = Hungry(limit_rank=0, budget=12, limit_in="eval")
strategy = MGPUDataParallelStrategy(micro_batch_size="auto")
trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, **quiet)
trainer.validate(model, loader(regression_data(), 8))
seen["validate"] = model.eval_sizes_seen
with open("seen.json", "w") as f:
    json.dump(seen, f)
fit(Hungry(limit_rank=0, budget=32, forward_extra=40), 8, 2)  # never fits: the run ends
