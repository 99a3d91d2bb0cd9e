"""The tests' shared tiny model and quiet Trainer: what a test trains when neither is what it checks.

Tests and the scripts in tests/scripts/ import it (their processes get the repository on PYTHONPATH);
a script that injects a fault subclasses it and overrides one hook.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn


class Regression(L.LightningModule):
    """One linear layer (4 -> 1), mean squared error of ``batch[0]`` against ``batch[1]``, plain SGD."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def quiet_trainer(**options: Any) -> L.Trainer:
    """A CPU ``Trainer`` with no logger, checkpoints, progress bar or model summary unless ``options`` ask."""
    quiet = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return L.Trainer(**{"accelerator": "cpu", **quiet, **options})
