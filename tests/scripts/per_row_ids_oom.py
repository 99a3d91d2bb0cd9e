"""``mgpu_dp`` on one device, a real out-of-memory in backward: do the halves get their own rows' ids?

tests/strategies/microbatch/test_per_row_lists.py runs it with LIMITED_MEMORY's environment; it writes
the micro-batch sizes tried and each attempt's ids and rows to ``seen.json``.
"""

from __future__ import annotations

import json
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_mgpu.strategies.dp.strategy import MGPUDataParallelStrategy
from tests.strategies.microbatch._models import QUIET, Hungry
from tests.strategies.microbatch.test_per_row_lists import WithIds


class IdHungry(Hungry):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.parts: list[tuple[list[str], list[int]]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, ids = batch
        self.parts.append((list(ids), [int(v) for v in x[:, 0].tolist()]))
        return super().training_step((x, y), batch_idx)


quiet: dict[str, Any] = QUIET  # bools, which mypy does not match to each keyword's own type
# backward needs about 4 row-sizes per row: 24 fit 4 rows, not 8
model = IdHungry(limit_rank=0, budget=24)
strategy = MGPUDataParallelStrategy(micro_batch_size="auto")
trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, **quiet)
trainer.fit(model, DataLoader(WithIds(), batch_size=8))
with open("seen.json", "w") as f:
    json.dump({"sizes": model.sizes_seen, "parts": model.parts}, f)
