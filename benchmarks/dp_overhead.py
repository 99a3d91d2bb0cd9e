"""Step time of ``mgpu_dp`` against one device on the same global batch, measured side by side.

Usage::

    python benchmarks/dp_overhead.py                      # CPU: 2 replicas in threads vs one device
    python benchmarks/dp_overhead.py --replicas 3 --steps 30

CPU target: ``mgpu_dp`` at most 1.10x the single-device step time on the same cores: one
device runs its ops with T intra-op threads and each of the N replicas with T/N, so the
comparison isolates what splitting, replicating, threading and combining cost. The last
CPU line leaves the thread settings at their defaults, as a user gets them. With CUDA present it
also times, on the same model and batch, a plain single GPU, ``torch.nn.DataParallel``
and ``mgpu_dp`` over one GPU (and over every GPU when there are several); target: no
slower than ``torch.nn.DataParallel``.

Each configuration is a real ``Trainer.fit``; a callback times every training batch
(forward, backward, optimizer step and the Lightning loop around them). Configurations
run in interleaved rounds and the median step time is reported.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mgpu  # noqa: F401  registers mgpu_dp

WIDTH, HIDDEN, CLASSES = 512, 2048, 10


class StepTimer(L.Callback):
    """Wall time of each training batch after the warm-up ones."""

    def __init__(self, warmup: int, cuda: bool) -> None:
        self.warmup, self.cuda, self.times, self._start = warmup, cuda, [], 0.0

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        if trainer.global_step > self.warmup:
            self.times.append(time.perf_counter() - self._start)


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(WIDTH, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES)
    )


class Model(L.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def step_ms(
    net: nn.Module,
    accelerator: str,
    devices: Any,
    strategy: str,
    batch: int,
    steps: int,
    warmup: int,
    threads: int | None = None,
) -> float:
    default_threads = torch.get_num_threads()
    if threads is not None:
        # threads started afterwards (the replicas') take this value too
        torch.set_num_threads(threads)
    try:
        return _fit_and_time(net, accelerator, devices, strategy, batch, steps, warmup)
    finally:
        torch.set_num_threads(default_threads)


def _fit_and_time(
    net: nn.Module, accelerator: str, devices: Any, strategy: str, batch: int, steps: int, warmup: int
) -> float:
    x = torch.randn(batch * (steps + warmup), WIDTH)
    data = DataLoader(TensorDataset(x, torch.randint(0, CLASSES, (len(x),))), batch_size=batch)
    timer = StepTimer(warmup, cuda=accelerator == "gpu")
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=strategy,
        max_steps=steps + warmup,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model(net), data)
    return 1000 * statistics.median(timer.times)


def measure(configs: dict[str, Any], rounds: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(rounds):
        for name, run in configs.items():
            samples[name].append(run())
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2, help="CPU replicas for mgpu_dp (default: 2)")
    parser.add_argument("--batch", type=int, default=256, help="global batch size (default: 256)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run (default: 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per run (default: 3)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: 3)")
    args = parser.parse_args()
    common = {"batch": args.batch, "steps": args.steps, "warmup": args.warmup}
    model = (
        f"MLP {WIDTH}-{HIDDEN}-{HIDDEN}-{CLASSES}, global batch {args.batch}, median of {args.rounds} rounds"
    )

    n, cores = args.replicas, torch.get_num_threads()
    per_replica = max(1, cores // n)
    cpu = measure(
        {
            f"single device, {cores} threads": lambda: step_ms(make_net(), "cpu", 1, "auto", **common),
            f"mgpu_dp x{n}, {per_replica} each": lambda: step_ms(
                make_net(), "cpu", n, "mgpu_dp", threads=per_replica, **common
            ),
            f"mgpu_dp x{n}, default": lambda: step_ms(make_net(), "cpu", n, "mgpu_dp", **common),
        },
        args.rounds,
    )
    print(f"CPU ({cores} cores for intra-op threads), {model}")
    base = next(iter(cpu.values()))
    for name, ms in cpu.items():
        print(f"  {name:<28}{ms:9.2f} ms/step   {ms / base:.3f}x single device")

    if not torch.cuda.is_available():
        print("GPU: no CUDA device here; the GPU comparison runs only where CUDA is present")
        return
    gpus = list(range(torch.cuda.device_count()))
    configs = {
        "single device": lambda: step_ms(make_net(), "gpu", [0], "auto", **common),
        "nn.DataParallel [0]": lambda: step_ms(
            nn.DataParallel(make_net(), [0]), "gpu", [0], "auto", **common
        ),
        "mgpu_dp [0]": lambda: step_ms(make_net(), "gpu", [0], "mgpu_dp", **common),
    }
    if len(gpus) > 1:
        configs[f"nn.DataParallel {gpus}"] = lambda: step_ms(
            nn.DataParallel(make_net(), gpus), "gpu", [0], "auto", **common
        )
        configs[f"mgpu_dp {gpus}"] = lambda: step_ms(make_net(), "gpu", gpus, "mgpu_dp", **common)
    gpu = measure(configs, args.rounds)
    print(f"GPU ({torch.cuda.get_device_name(0)} x{len(gpus)}), {model}")
    base = gpu["single device"]
    for name, ms in gpu.items():
        line = f"  {name:<28}{ms:9.2f} ms/step   {ms / base:.3f}x single device"
        if name.startswith("mgpu_dp"):
            reference = gpu["nn.DataParallel " + name.split(" ", 1)[1]]
            line += f"   {ms / reference:.3f}x nn.DataParallel"
        print(line)


if __name__ == "__main__":
    main()
