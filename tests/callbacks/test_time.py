"""DeviceTimeMonitor in one process: what it counts in each phase, what it leaves out, and its report
beside DeviceMemoryMonitor's."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import DeviceMemoryMonitor, DeviceTimeMonitor


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
            start = time.perf_counter()
            time.sleep(0.05)
            validated.append(time.perf_counter() - start)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    validated: list[float] = []
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
    assert len(validated) == 32
    assert only.data_s < sum(validated), only  # counted as data loading, validation's sleeps alone exceed it
    assert monitor.verdict is not None
    assert monitor.verdict.phase != "data loading", monitor.verdict.line()


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def monitored_fit(tmp_path: Path, callbacks: list[Any]) -> None:
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path, callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(Tiny(), DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4))


def test_both_monitors_read_as_one_report_at_start_and_end(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Memory and time: one block at the start (what each watches) and one at the end (both tables)."""
    monitored_fit(tmp_path, [DeviceMemoryMonitor(), DeviceTimeMonitor()])
    messages = [m for m in caplog.messages if "Monitor" in m or "over the fit" in m]
    start, end = messages
    assert start.startswith("Monitors of this fit:\nDeviceMemoryMonitor: memory of 1 device(s)")
    assert "\nDeviceTimeMonitor: data loading, work and waiting of 1 rank(s) (no other rank" in start
    assert end.startswith("End of fit, every device:\nDevice memory over the fit (peaks):")
    assert "\nTime per rank over the fit:" in end
    assert "Time: " in end.splitlines()[-1]  # the verdict closes the report

    caplog.clear()  # one monitor alone, the other silenced: its own blocks, no heading
    monitored_fit(tmp_path, [DeviceMemoryMonitor(print_summary=False), DeviceTimeMonitor()])
    text = caplog.text
    assert "DeviceTimeMonitor: data loading" in text
    assert "Time per rank over the fit:" in text
    assert "Monitors of this fit" not in text
    assert "End of fit, every device" not in text
    assert "Device memory over the fit" not in text
