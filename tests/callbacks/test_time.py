"""DeviceTimeMonitor in one process: what it counts in each phase, and what it leaves out."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import DeviceTimeMonitor


def test_validation_inside_an_epoch_is_not_counted_as_data_loading(tmp_path: Path) -> None:
    """One process, a quick loader and a slow validation every 2 batches: the verdict must not blame the
    loader for the time validation took between two training batches."""

    class SlowValidation(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            time.sleep(0.02)  # work that dwarfs fetching a batch of a TensorDataset
            return self.net(batch[0]).pow(2).mean()

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            time.sleep(0.05)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=4)
    monitor = DeviceTimeMonitor(summary_file=None)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, val_check_interval=2, num_sanity_val_steps=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path, callbacks=[monitor],
    )  # fmt: skip
    trainer.fit(SlowValidation(), data, data)  # 4 validations of 8 batches: about 1.6 s
    (only,) = monitor.totals
    assert only.steps == 8
    assert only.data_s < 0.4, only  # validation's 1.6 s would be here
    assert monitor.verdict is not None
    assert monitor.verdict.phase != "data loading", monitor.verdict.line()
