"""Two ``mgpu_ddp`` ranks in micro-batches of 2 rows: each part's ids and rows (test_per_row_lists.py).

Each rank writes the ids and rows of every micro-batch it ran to ``parts_rank{N}.json``.
"""

from __future__ import annotations

import json
from typing import Any

import lightning as L
from torch.utils.data import DataLoader

from lightning_mgpu import MGPUDDPStrategy
from tests.strategies.microbatch._models import QUIET
from tests.strategies.microbatch.test_per_row_lists import IdModel, WithIds

quiet: dict[str, Any] = QUIET  # bools, which mypy does not match to each keyword's own type
parts: list[Any] = []
trainer = L.Trainer(
    accelerator="cpu", devices=2, strategy=MGPUDDPStrategy(micro_batch_size=2), max_steps=2, **quiet
)
trainer.fit(IdModel(parts), DataLoader(WithIds(), batch_size=4))
with open(f"parts_rank{trainer.global_rank}.json", "w") as f:
    json.dump(parts, f)
