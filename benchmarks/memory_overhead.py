"""What DeviceMemoryMonitor and DeviceTimeMonitor cost per training step, logging every step, side by side.

Usage::

    python benchmarks/memory_overhead.py                  # one process (CPU, or one GPU when present)
    python benchmarks/memory_overhead.py --devices 2      # mgpu_ddp: every step also all-gathers the ranks

The same MLP trains with a CSVLogger and ``log_every_n_steps=1`` under each callback:
``DeviceMemoryMonitor(every_n_steps=1)``, ``DeviceTimeMonitor()`` (one gather every 25 batches),
both together, and Lightning's ``DeviceStatsMonitor``. Within
each run the callbacks' per-step hooks run on odd batches only, so every step with the
callback has a neighbour without it, measured a few milliseconds apart: the paired
difference cancels the load of a shared machine that separate runs cannot. Reported:

- the median step without the callback (the baseline), the median paired difference
  (step with minus the step before without) and the resulting step-time ratio, with its noise
  (about one standard error of the median: 1.57 x interquartile range / sqrt(pairs));
- the time spent inside the callback's per-step hooks, measured directly, as a share of
  the baseline step;
- the once-per-fit hooks (``on_train_start`` / ``_end``: layout exchange, table, JSON) in
  ms per fit; under DDP they include waiting for the slower rank to arrive.
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

from lightning_mgpu import DeviceMemoryMonitor, DeviceTimeMonitor

STEP_HOOKS = ("on_train_batch_start", "on_train_batch_end")
FIT_HOOKS = ("setup", "on_train_start", "on_train_epoch_start", "on_train_end")
CONFIGS = ("DeviceMemoryMonitor", "DeviceTimeMonitor", "both monitors", "DeviceStatsMonitor")


def callbacks_of(config: str) -> list[Callback]:
    memory = DeviceMemoryMonitor(every_n_steps=1, print_summary=False)
    time_monitor = DeviceTimeMonitor(print_summary=False, summary_file=None)
    return {
        "DeviceMemoryMonitor": [memory],
        "DeviceTimeMonitor": [time_monitor],
        "both monitors": [memory, time_monitor],
        "DeviceStatsMonitor": [DeviceStatsMonitor()],
    }[config]


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


def on_odd_batches_timed(callback: Callback, spent: list[float]) -> Callback:
    """Per-step hooks run on odd batches only; their seconds add to ``spent[0]``, per-fit ones to ``[1]``."""

    def wrap(method: Callable[..., Any], per_step: bool) -> Callable[..., Any]:
        @functools.wraps(method)
        def hook(*args: Any, **kwargs: Any) -> Any:
            if per_step and args[-1] % 2 == 0:  # batch_idx is the last argument
                return None
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[0 if per_step else 1] += time.perf_counter() - start

        return hook

    for hooks, per_step in ((STEP_HOOKS, True), (FIT_HOOKS, False)):
        for name in hooks:
            setattr(callback, name, wrap(getattr(callback, name), per_step))
    return callback


def one_run(config: str, args: argparse.Namespace, loader: DataLoader, log_dir: str) -> dict[str, Any]:
    clock, spent = StepClock(), [0.0, 0.0]
    callbacks = [on_odd_batches_timed(callback, spent) for callback in callbacks_of(config)]
    trainer = L.Trainer(
        accelerator="gpu" if torch.cuda.is_available() else "cpu",
        devices=args.devices,
        strategy="mgpu_ddp" if args.devices > 1 else "auto",
        max_steps=args.steps,
        logger=CSVLogger(log_dir, name=config),
        log_every_n_steps=1,
        callbacks=[clock, *callbacks],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    torch.manual_seed(0)
    trainer.fit(MLP(args.width), loader)
    steps = [b - a for a, b in zip(clock.starts, clock.starts[1:], strict=False)]
    pairs = [(steps[i - 1], steps[i]) for i in range(args.warmup | 1, len(steps), 2)]  # (without, with)
    return {
        "without": [a for a, _ in pairs],
        "diffs": [b - a for a, b in pairs],
        "hook": spent[0] / max(1, len(steps) // 2),
        "fit": spent[1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--devices", type=int, default=1, help="processes (mgpu_ddp when more than 1)")
    parser.add_argument("--steps", type=int, default=100, help="training steps per run (default: 100)")
    parser.add_argument("--warmup", type=int, default=10, help="first steps left out (default: 10)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default: 2)")
    parser.add_argument("--width", type=int, default=1024, help="hidden width of the MLP (default: 1024)")
    parser.add_argument("--batch-size", type=int, default=128)
    args = parser.parse_args()

    n = args.steps * args.batch_size * args.devices
    data = TensorDataset(torch.randn(n, 256), torch.randint(0, 10, (n,)))
    loader = DataLoader(data, batch_size=args.batch_size)
    configs = CONFIGS
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory() as log_dir:
        for _ in range(args.rounds):
            for config in configs:
                runs[config].append(one_run(config, args, loader, log_dir))
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:  # rank 0 reports for mgpu_ddp
        return

    device = "cuda" if torch.cuda.is_available() else "cpu"
    pairs = sum(len(r["diffs"]) for r in runs[configs[0]])
    print(
        f"monitor overhead: {device}, {args.devices} process(es), MLP width {args.width},"
        f" batch {args.batch_size}, logging every step; {pairs} step pairs per callback"
        f" over {args.rounds} interleaved rounds"
    )
    row = "{:<20} {:>16} {:>16} {:>18} {:>14} {:>10} {:>13}"
    print(
        row.format(
            "callback",
            "step ms without",
            "paired diff ms",
            "step ratio",
            "hooks ms/step",
            "hooks %",
            "fit hooks ms",
        )
    )
    hook_ms = {}
    for config in configs:
        base = statistics.median(x for r in runs[config] for x in r["without"])
        diffs = [x for r in runs[config] for x in r["diffs"]]
        diff = statistics.median(diffs)
        noise = _median_noise(diffs)
        hook_ms[config] = statistics.median(r["hook"] for r in runs[config])
        fit = statistics.median(r["fit"] for r in runs[config])
        print(
            row.format(
                config,
                f"{base * 1e3:.3f}",
                f"{diff * 1e3:+.3f}",
                f"{(base + diff) / base:.4f} ± {noise / base:.4f}",
                f"{hook_ms[config] * 1e3:.4f}",
                f"{100 * hook_ms[config] / base:.3f}%",
                f"{fit * 1e3:.2f}",
            )
        )
    theirs = configs[-1]
    for ours in configs[:-1]:
        print(f"hook time {ours} / {theirs}: {hook_ms[ours] / hook_ms[theirs]:.3f}")


def _median_noise(values: list[float]) -> float:
    """About one standard error of a median: 1.57 x interquartile range / sqrt(n) (McGill's notch)."""
    if len(values) < 4:
        return float("nan")
    q1, _, q3 = statistics.quantiles(values, n=4)
    return 1.57 * (q3 - q1) / len(values) ** 0.5


if __name__ == "__main__":
    main()
