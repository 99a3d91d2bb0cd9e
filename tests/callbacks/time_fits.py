"""Fits timed by ``DeviceTimeMonitor`` and, outside it, by the sleeps a slow rank makes.

Usage::

    python time_fits.py LOG_DIR STRATEGY DEVICES MODE [MODE ...]

``MODE`` is ``data`` (rank 1's Dataset sleeps), ``work`` (rank 1's training_step sleeps),
``even`` (every rank's training_step sleeps the same), ``data0`` (rank 0's Dataset sleeps) or
``fail`` (rank 1's fifth training_step raises, after the monitor's first gather);
each mode is one fit. Every rank prints one ``OUTSIDE {json}`` line per fit: what it slept,
the seconds from the start of the epoch to the end of training, those of its steps, and how many
files (sockets included) the process holds open after the fit.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_mgpu import DeviceTimeMonitor

SLEEP = 0.1  # seconds per batch of 4 that a slow rank sleeps: far above the compute
SLEPT = {"data": 0.0, "work": 0.0}


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def sleep(phase: str, seconds: float) -> None:
    start = time.perf_counter()
    time.sleep(seconds)
    SLEPT[phase] += time.perf_counter() - start


class Data(Dataset):
    def __init__(self, mode: str) -> None:
        self.mode = mode

    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if (self.mode, rank()) in (("data", 1), ("data0", 0)):
            sleep("data", SLEEP / 4)
        return torch.randn(8), torch.randn(1)


class Model(L.LightningModule):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.net = nn.Linear(8, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.mode == "fail" and self.global_rank == 1 and batch_idx == 4:
            raise RuntimeError("rank 1 fails at batch 4")
        if self.mode == "even" or (self.mode == "work" and self.global_rank == 1):
            sleep("work", SLEEP)
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Clock(Callback):
    """The seconds from the start of the training epoch to the end of training, and those of the steps
    (``on_train_batch_start`` to ``on_train_batch_end``: the same hooks as the monitor's)."""

    def __init__(self) -> None:
        self.start = self.seconds = self.step_start = self.steps = 0.0

    def on_train_epoch_start(self, *args: Any) -> None:
        self.start = time.perf_counter()

    def on_train_batch_start(self, *args: Any) -> None:
        self.step_start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.steps += time.perf_counter() - self.step_start

    def on_train_end(self, *args: Any) -> None:
        self.seconds = time.perf_counter() - self.start


def fit(log_dir: str, strategy: str, devices: int, mode: str) -> None:
    SLEPT.update(data=0.0, work=0.0)
    clock = Clock()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=1,
        logger=CSVLogger(log_dir, name=mode),
        callbacks=[clock, DeviceTimeMonitor(flush_every_n_steps=3)],
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model(mode), DataLoader(Data(mode), batch_size=4))
    outside = {
        "mode": mode,
        "rank": trainer.global_rank,
        "seconds": clock.seconds,
        "steps_s": clock.steps,
        "log_dir": trainer.log_dir,
        "open_files": len(os.listdir("/proc/self/fd")),
    }
    # one write: the two ranks share the pipe, and a line written in pieces may interleave
    sys.stdout.write(f"OUTSIDE {json.dumps({**outside, **SLEPT})}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    for name in sys.argv[4:]:
        fit(sys.argv[1], sys.argv[2], int(sys.argv[3]), name)
