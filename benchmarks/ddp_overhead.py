"""Time per training step of ``mgpu_ddp`` against Lightning's ``ddp`` and a hand-written DDP loop.

Usage::

    python benchmarks/ddp_overhead.py                  # 2 CPU processes, a few minutes
    python benchmarks/ddp_overhead.py --rounds 8 --steps 40

The same MLP (about 5.5M parameters), data, batch size and steps run in the same two
CPU processes (gloo), three ways (and ``ddp`` once more, to show the noise):

- ``hand``: the loop the tutorials write: ``init_process_group`` (here: the group Lightning
  already made), ``DistributedSampler``, ``DistributedDataParallel``, forward, backward, step;
- ``ddp``: ``Trainer(strategy="ddp").fit``;
- ``mgpu_ddp``: ``Trainer(strategy="mgpu_ddp").fit``, watchdog and all.

The ways take turns in short blocks, in a rotating order, inside one pair of processes, so
that the load of a shared machine hits all of them alike. Rank 0 records the wall time and
its process's CPU time (all threads, the watchdog's included) of every step but the first
few of each block, and prints the medians per way and the ratios against the targets
(``mgpu_ddp`` <= 1.02x ``ddp`` and <= 1.10x ``hand``).
Lightning's launcher starts the second process by running this script again.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_mgpu  # noqa: F401  registers mgpu_ddp

WAYS = ("hand", "ddp", "mgpu_ddp", "ddp_again")
"""``ddp_again`` runs ``ddp`` a second time: its ratio to ``ddp`` is the noise of the measurement."""
WORLD = 2
BATCH = 32
WIDTH, HIDDEN = 1024, 1536
SKIP = 3
"""Steps at the start of each block that are not timed (bucket rebuilds, allocator warm-up)."""


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(WIDTH, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, WIDTH)
    )


def build_data(steps: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    n = steps * BATCH * WORLD
    x = torch.randn(n, WIDTH, generator=generator)
    return TensorDataset(x, torch.randn(n, WIDTH, generator=generator))


def hand_block(steps: int) -> list[tuple[float, float]]:
    """The hand-written loop, one epoch of ``steps`` batches per rank."""
    model = DistributedDataParallel(build_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    dataset = build_data(steps)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset, shuffle=True))
    stamps = []
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        stamps.append((time.perf_counter(), time.process_time()))
    return stamps


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = build_model()

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Stamps(L.Callback):
    def __init__(self) -> None:
        self.stamps: list[tuple[float, float]] = []

    def on_train_batch_end(self, *args: object) -> None:
        self.stamps.append((time.perf_counter(), time.process_time()))


def lightning_block(strategy: str, steps: int) -> tuple[list[tuple[float, float]], int]:
    stamps = Stamps()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_steps=steps,
        callbacks=[stamps],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(Regression(), DataLoader(build_data(steps), batch_size=BATCH, shuffle=True))
    return stamps.stamps, trainer.global_rank


def run_block(way: str, steps: int) -> list[tuple[float, float]]:
    if way == "hand":
        return hand_block(steps)
    return lightning_block(way.removesuffix("_again"), steps)[0]


def step_times(stamps: list[tuple[float, float]], clock: int) -> list[float]:
    """Seconds per step on the wall clock (``clock=0``) or of this process's CPU time (``1``)."""
    return [b[clock] - a[clock] for a, b in zip(stamps[SKIP:], stamps[SKIP + 1 :], strict=False)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per block (default: 20)")
    parser.add_argument("--rounds", type=int, default=12, help="blocks of each way (default: 12)")
    args = parser.parse_args()
    for name in ("lightning.pytorch", "lightning.fabric"):  # one summary, not one per block
        logging.getLogger(name).setLevel(logging.WARNING)

    # the first fit starts the second process and the process group; it is not timed
    _, rank = lightning_block("ddp", SKIP + 2)
    rounds: list[dict[str, list[tuple[float, float]]]] = []
    for round_index in range(args.rounds):
        order = WAYS[round_index % len(WAYS) :] + WAYS[: round_index % len(WAYS)]
        rounds.append({way: run_block(way, args.steps) for way in order})
        dist.barrier()
    if rank == 0:
        report(rounds, args.steps)


def report(rounds: list[dict[str, list[tuple[float, float]]]], steps: int) -> None:
    params = sum(p.numel() for p in build_model().parameters())
    print(f"MLP of {params / 1e6:.1f}M parameters, batch {BATCH} per process, {WORLD} CPU processes (gloo),")
    print(f"{len(rounds)} blocks of {steps} steps per way, rotating order, first {SKIP} of each untimed")
    print(f"{'way':10s} {'wall ms/step':>13s} {'CPU ms/step':>12s} {'steps timed':>12s}  (medians, rank 0)")
    for way in WAYS:
        wall = [t for r in rounds for t in step_times(r[way], 0)]
        cpu = [t for r in rounds for t in step_times(r[way], 1)]
        wall_ms, cpu_ms = statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3
        print(f"{way:10s} {wall_ms:13.1f} {cpu_ms:12.1f} {len(wall):12d}")
    # a round's blocks run seconds apart: the median of per-round ratios resists the
    # minutes-long swings of a shared machine; CPU time also ignores waiting for the CPU
    print(f"{'ratio (median of rounds)':26s} {'wall':>6s} {'CPU':>6s}  target")
    pairs = [("mgpu_ddp", "ddp", 1.02), ("mgpu_ddp", "hand", 1.10), ("ddp", "hand", None)]
    pairs.append(("ddp_again", "ddp", None))
    for way, base, target in pairs:
        ratios = []
        for clock in (0, 1):
            per_round = [
                statistics.median(step_times(r[way], clock)) / statistics.median(step_times(r[base], clock))
                for r in rounds
            ]
            ratios.append(statistics.median(per_round))
        goal = f"<= {target:.2f}: {'met' if ratios[0] <= target else 'NOT met'} (wall)" if target else ""
        if way == "ddp_again":
            goal = "the same code twice: the noise of this measurement"
        print(f"{way + ' / ' + base:26s} {ratios[0]:6.3f} {ratios[1]:6.3f}  {goal}")


if __name__ == "__main__":
    main()
