"""What DeviceMemoryMonitor costs per training step, logging every step, side by side.

Usage::

    python benchmarks/memory_overhead.py                  # one process (CPU, or one GPU when present)
    python benchmarks/memory_overhead.py --devices 2      # mgpu_ddp: every step also all-gathers the ranks

Three configurations train the same MLP, all with a CSVLogger and
``log_every_n_steps=1``: no memory callback, ``DeviceMemoryMonitor(every_n_steps=1)``
and Lightning's ``DeviceStatsMonitor``. Rounds are interleaved so that load on the
machine hits all three alike. Two figures per configuration:

- the median time between consecutive batch starts (the whole step), and its ratio to
  the run without a memory callback;
- the time spent inside the callback's own hooks, measured directly, as a share of the
  step: the noise-free figure that the 1% target is about.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, DeviceStatsMonitor
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import DeviceMemoryMonitor

HOOKS = ("on_train_batch_start", "on_train_batch_end", "on_train_start", "on_train_end")


class MLP(L.LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = nn.functional.cross_entropy(self.net(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class StepClock(Callback):
    """Records when each training batch starts; it runs first, so intervals include every other hook."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())

    def on_train_end(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())


def timed_hooks(callback: Callback, spent: list[float]) -> Callback:
    """Wrap the callback's hooks so that the seconds they take add up in ``spent[0]``."""

    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start

        return timed

    for hook in HOOKS:
        setattr(callback, hook, wrap(getattr(callback, hook)))
    return callback


def one_run(
    config: str, args: argparse.Namespace, loader: DataLoader, log_dir: str
) -> tuple[list[float], float]:
    clock, spent = StepClock(), [0.0]
    callbacks: list[Callback] = [clock]
    if config == "DeviceMemoryMonitor":
        callbacks.append(timed_hooks(DeviceMemoryMonitor(every_n_steps=1, print_summary=False), spent))
    elif config == "DeviceStatsMonitor":
        callbacks.append(timed_hooks(DeviceStatsMonitor(), spent))
    gpu = torch.cuda.is_available()
    trainer = L.Trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=args.devices,
        strategy="mgpu_ddp" if args.devices > 1 else "auto",
        max_steps=args.steps,
        logger=CSVLogger(log_dir, name=config),
        log_every_n_steps=1,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    torch.manual_seed(0)
    trainer.fit(MLP(args.width), loader)
    steps = [b - a for a, b in zip(clock.starts, clock.starts[1:], strict=False)][args.warmup :]
    return steps, spent[0] / max(1, len(clock.starts) - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1, help="processes (mgpu_ddp when more than 1)")
    parser.add_argument("--steps", type=int, default=60, help="training steps per run (default: 60)")
    parser.add_argument("--warmup", type=int, default=10, help="first steps left out of the medians")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: 3)")
    parser.add_argument("--width", type=int, default=1024, help="hidden width of the MLP (default: 1024)")
    parser.add_argument("--batch-size", type=int, default=128)
    args = parser.parse_args()

    n = args.steps * args.batch_size * args.devices
    data = TensorDataset(torch.randn(n, 256), torch.randint(0, 10, (n,)))
    loader = DataLoader(data, batch_size=args.batch_size)
    configs = ("none", "DeviceMemoryMonitor", "DeviceStatsMonitor")
    steps: dict[str, list[float]] = {c: [] for c in configs}
    hooks: dict[str, list[float]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory() as log_dir:
        for _ in range(args.rounds):
            for config in configs:
                s, h = one_run(config, args, loader, log_dir)
                steps[config] += s
                hooks[config].append(h)
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:  # rank 0 reports for mgpu_ddp
        return

    base = statistics.median(steps["none"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(
        f"memory callback overhead: {device}, {args.devices} process(es), MLP width {args.width},"
        f" batch {args.batch_size}, {args.rounds} rounds x {args.steps - args.warmup} timed steps,"
        " logging every step"
    )
    row = "{:<22} {:>17} {:>9} {:>14} {:>16}"
    print(row.format("configuration", "step ms (median)", "vs none", "hooks ms/step", "hooks % of step"))
    med = {c: statistics.median(steps[c]) for c in configs}
    hook = {c: statistics.median(hooks[c]) for c in configs}
    for c in configs:
        share = f"{100 * hook[c] / base:.3f}%"
        print(row.format(c, f"{med[c] * 1e3:.3f}", f"{med[c] / base:.4f}", f"{hook[c] * 1e3:.4f}", share))
    ours, theirs = "DeviceMemoryMonitor", "DeviceStatsMonitor"
    print(f"hook time {ours} / {theirs}: {hook[ours] / hook[theirs]:.3f}")
    print(f"step time {ours} / {theirs}: {med[ours] / med[theirs]:.4f}")


if __name__ == "__main__":
    main()
