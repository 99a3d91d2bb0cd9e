"""Token losses over two ``mgpu_ddp`` ranks (tests/strategies/microbatch/test_global_mean.py).

Rank 0 saves each loss kind's final weights to ``ddp.pt``, to compare with one device's batches of 16.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from tests.strategies.microbatch._models import QUIET, TokenModel, loader, token_data

quiet: dict[str, Any] = QUIET  # bools, which mypy does not match to each keyword's own type
results = {}
for kind in ("masked", "sum", "naive"):
    model = TokenModel(kind)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="mgpu_ddp", max_steps=2, **quiet)
    trainer.fit(model, loader(token_data(), 8))
    results[kind] = model.state_dict()
if trainer.is_global_zero:
    torch.save(results, "ddp.pt")
