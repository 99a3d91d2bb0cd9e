"""DeviceTimeMonitor on CUDA: its per-batch hooks add no synchronisation, and its events time the batches."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import DeviceTimeMonitor

pytestmark = pytest.mark.gpu


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def no_sync(hook: Any) -> Any:
    """Run ``hook`` with CUDA's synchronising calls turned into errors."""

    @functools.wraps(hook)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        torch.cuda.set_sync_debug_mode("error")
        try:
            return hook(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    return wrapped


def test_batch_hooks_never_synchronize_and_every_batch_is_timed(tmp_path: Path) -> None:
    monitor = DeviceTimeMonitor(flush_every_n_steps=4)
    for name in ("on_train_batch_start", "on_train_batch_end"):  # the end of fit may wait for the GPU
        setattr(monitor, name, no_sync(getattr(monitor, name)))
    data = DataLoader(TensorDataset(torch.randn(160, 64), torch.randn(160, 1)), batch_size=16)
    trainer = L.Trainer(
        accelerator="gpu",
        devices=1,
        max_epochs=1,
        callbacks=[monitor],
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model(), data)
    (row,) = monitor.totals
    assert (row.device, row.steps, row.samples) == ("cuda:0", 10, 160)
    assert row.work_s > 0
    assert row.wait_s is None
    assert (tmp_path / "time_summary.json").is_file()
