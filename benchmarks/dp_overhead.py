"""Step time of ``mgpu_dp`` against one device on the same global batch, measured side by side.

Usage::

    python benchmarks/dp_overhead.py                      # CPU: 2 replicas in threads vs one device
    python benchmarks/dp_overhead.py --model mlp --replicas 3 --steps 30

Two models, each on the same global batch:

- ``cnn``: the convolutional MNIST classifier of the PyTorch examples and the DataParallel
  tutorials (two 3x3 convolutions, max-pool, 9216-128-10 head), on 1x28x28 inputs;
- ``mlp``: a 512-2048-2048-10 MLP, 5.3M weights, almost all its time in matrix products
  whose weight gradients are as large as the weights: data parallelism's worst case on one
  memory system, since every replica computes a full-size gradient of every weight from
  its part of the batch and the replicas' gradients are then summed.

CPU target: ``mgpu_dp`` at most 1.10x the single-device step time. Both use the same
cores: one device runs its ops with T intra-op threads, and mgpu_dp gives each of its N
replicas T/N of them, so the ratio shows what splitting, replicating, threading and
combining cost. A third contender, "split by hand", is one device whose ``training_step``
cuts the batch into the same N chunks and sums their losses weighted by size, in one
thread: the arithmetic of data parallelism without any strategy, so ``mgpu_dp`` against it
shows what the strategy itself costs. With CUDA present it
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
from lightning_mgpu.strategies.split.batch import split_sizes

WIDTH, HIDDEN, CLASSES = 512, 2048, 10
INPUTS = {"mlp": (WIDTH,), "cnn": (1, 28, 28)}


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


def make_net(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 32, 3),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(9216, 128),
            nn.ReLU(),
            nn.Linear(128, CLASSES),
        )
    return nn.Sequential(
        nn.Linear(WIDTH, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES)
    )


class Model(L.LightningModule):
    """``net`` with a cross-entropy loss; ``chunks > 1`` splits each batch by hand (see the module doc)."""

    def __init__(self, net: nn.Module, chunks: int = 1) -> None:
        super().__init__()
        self.net = net
        self.chunks = chunks

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.chunks == 1:
            return F.cross_entropy(self.net(x), y)
        sizes = split_sizes(len(x), self.chunks)
        parts = zip(x.split(sizes), y.split(sizes), strict=True)
        return sum(F.cross_entropy(self.net(a), b) * (len(a) / len(x)) for a, b in parts)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def step_ms(
    net: nn.Module,
    kind: str,
    accelerator: str,
    devices: Any,
    strategy: str,
    batch: int,
    steps: int,
    warmup: int,
    chunks: int = 1,
) -> float:
    x = torch.randn(batch * (steps + warmup), *INPUTS[kind])
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
    trainer.fit(Model(net, chunks), data)
    return 1000 * statistics.median(timer.times)


def measure(configs: dict[str, Any], rounds: int) -> dict[str, list[float]]:
    """Each configuration's median step time per round; the rounds interleave the configurations."""
    samples: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(rounds):
        for name, run in configs.items():
            samples[name].append(run())
    return samples


def report(samples: dict[str, list[float]], base: str, reference: dict[str, str] | None = None) -> None:
    """Median over rounds, the rounds' spread, and the ratios of the medians."""
    medians = {name: statistics.median(values) for name, values in samples.items()}
    for name, values in samples.items():
        ms = medians[name]
        line = f"  {name:<26}{ms:9.2f} ms/step  (rounds {min(values):.1f}-{max(values):.1f})"
        line += f"   {ms / medians[base]:.3f}x {base}"
        if reference and name in reference:
            line += f"   {ms / medians[reference[name]]:.3f}x {reference[name]}"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2, help="CPU replicas for mgpu_dp (default: 2)")
    parser.add_argument("--batch", type=int, default=256, help="global batch size (default: 256)")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per run (default: 12)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per run (default: 3)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default: 5)")
    parser.add_argument(
        "--model", choices=("cnn", "mlp", "both"), default="both", help="model(s) to time (default: both)"
    )
    args = parser.parse_args()

    for kind in ("cnn", "mlp") if args.model == "both" else (args.model,):
        run_model(kind, args)


def run_model(kind: str, args: argparse.Namespace) -> None:
    common = {"batch": args.batch, "steps": args.steps, "warmup": args.warmup}
    model = {
        "cnn": "CNN (MNIST example: conv 32, conv 64, pool, 9216-128-10) on 1x28x28",
        "mlp": f"MLP {WIDTH}-{HIDDEN}-{HIDDEN}-{CLASSES}",
    }[kind] + f", global batch {args.batch}, median of {args.rounds} rounds"

    n, cores = args.replicas, torch.get_num_threads()
    cpu = measure(
        {
            "single device": lambda: step_ms(make_net(kind), kind, "cpu", 1, "auto", **common),
            f"split by hand in {n}": lambda: step_ms(
                make_net(kind), kind, "cpu", 1, "auto", chunks=n, **common
            ),
            f"mgpu_dp, {n} CPU replicas": lambda: step_ms(
                make_net(kind), kind, "cpu", n, "mgpu_dp", **common
            ),
        },
        args.rounds,
    )
    print(f"CPU ({cores} intra-op threads), {model}")
    report(cpu, "single device", {f"mgpu_dp, {n} CPU replicas": f"split by hand in {n}"})

    if not torch.cuda.is_available():
        print("GPU: no CUDA device here; the GPU comparison runs only where CUDA is present")
        return
    gpus = list(range(torch.cuda.device_count()))
    configs = {
        "single device": lambda: step_ms(make_net(kind), kind, "gpu", [0], "auto", **common),
        "nn.DataParallel [0]": lambda: step_ms(
            nn.DataParallel(make_net(kind), [0]), kind, "gpu", [0], "auto", **common
        ),
        "mgpu_dp [0]": lambda: step_ms(make_net(kind), kind, "gpu", [0], "mgpu_dp", **common),
    }
    if len(gpus) > 1:
        configs[f"nn.DataParallel {gpus}"] = lambda: step_ms(
            nn.DataParallel(make_net(kind), gpus), kind, "gpu", [0], "auto", **common
        )
        configs[f"mgpu_dp {gpus}"] = lambda: step_ms(make_net(kind), kind, "gpu", gpus, "mgpu_dp", **common)
    gpu = measure(configs, args.rounds)
    print(f"GPU ({torch.cuda.get_device_name(0)} x{len(gpus)}), {model}")
    dp_names = [name for name in configs if name.startswith("mgpu_dp")]
    report(gpu, "single device", {name: "nn.DataParallel " + name.split(" ", 1)[1] for name in dp_names})


if __name__ == "__main__":
    main()
