"""Step time of ``mgpu_ddp`` with micro-batching on and no out-of-memory, and what one recovery costs.

Usage::

    python benchmarks/microbatch.py                  # 2 CPU processes, a few minutes
    python benchmarks/microbatch.py --rounds 8 --steps 30
    python benchmarks/microbatch.py --strategy mgpu_fsdp   # the same under mgpu_fsdp

The MLP, data and batch of ``ddp_overhead.py`` run in the same two CPU processes (gloo), four ways:

- ``off``: ``MGPUDDPStrategy()`` (or ``MGPUFSDPStrategy()`` with ``--strategy mgpu_fsdp``), no
  micro-batching;
- ``whole``: ``micro_batch_size=BATCH``: a batch that fits the size runs unsplit;
- ``auto``: ``micro_batch_size="auto"`` with nothing running out of memory: the whole batch
  in one micro-batch, the agreement all-reduce, DDP's sync done once after backward (under
  ``mgpu_fsdp``: its reduce-scatters as usual; the first step also announces each collective);
- ``off_again``: ``off`` once more, to show the noise.

The ways take turns in blocks, in a rotating order, and rank 0 prints the median step times and
the median of the per-round ratios (target: ``auto`` and ``whole`` <= 1.02x ``off``).

Then one ``auto`` fit whose forward also fills 4 MiB per row, in which rank 1 runs out of memory
for real at step ``RECOVER_AT`` (its address space is limited for that step to room for three
quarters of the batch's fill):
printed are that step's time beside the median step before it, and the steady state after it
(rank 1 in micro-batches of half the batch) beside the steps before.
Lightning's launcher starts the second process by running this script again.
"""

from __future__ import annotations

import argparse
import logging
import resource
import statistics
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from ddp_overhead import BATCH, SKIP, WORLD, Stamps, build_data, build_model, step_times
from torch import nn
from torch.utils.data import DataLoader

from lightning_mgpu import MGPUDDPStrategy, MGPUFSDPStrategy

WAYS = ("off", "whole", "auto", "off_again")
RECOVER_AT = 10
RECOVERY_STEPS = 30
PAD_FLOATS = 2**20
"""The recovery fit's forward fills ``PAD_FLOATS`` floats per row for a moment (4 MiB a row)."""


class Regression(L.LightningModule):
    def __init__(self, pad: bool = False) -> None:
        super().__init__()
        self.net = build_model()
        self.pad = pad

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if not self.pad or self.global_rank != 1:
            return
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        if self.trainer.global_step == RECOVER_AT:  # room for half the batch's pads, not all of them
            with open("/proc/self/status") as status:
                held = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
            resource.setrlimit(resource.RLIMIT_AS, (held + 4 * PAD_FLOATS * BATCH * 3 // 4, hard))
        elif self.trainer.global_step == RECOVER_AT + 1:
            resource.setrlimit(resource.RLIMIT_AS, (hard, hard))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.pad:  # 4 MiB per row, filled and dropped in forward
            with torch.no_grad():
                x.new_empty(len(x), PAD_FLOATS).fill_(1.0)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


STRATEGIES = {"mgpu_ddp": MGPUDDPStrategy, "mgpu_fsdp": MGPUFSDPStrategy}


def fit(way: str, steps: int, strategy: str, pad: bool = False) -> tuple[list[tuple[float, float]], int]:
    micro: int | str | None = {"whole": BATCH, "auto": "auto"}.get(way.removesuffix("_again"))
    stamps = Stamps()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=STRATEGIES[strategy](micro_batch_size=micro),
        max_steps=steps,
        callbacks=[stamps],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regression(pad), DataLoader(build_data(steps), batch_size=BATCH))
    return stamps.stamps, trainer.global_rank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per block (default: 20)")
    parser.add_argument("--rounds", type=int, default=8, help="blocks of each way (default: 8)")
    parser.add_argument("--strategy", choices=sorted(STRATEGIES), default="mgpu_ddp")
    args = parser.parse_args()
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)

    _, rank = fit("off", SKIP + 2, args.strategy)  # starts the second process and the group; not timed
    rounds: list[dict[str, list[float]]] = []
    for index in range(args.rounds):
        order = WAYS[index % len(WAYS) :] + WAYS[: index % len(WAYS)]
        rounds.append({way: step_times(fit(way, args.steps, args.strategy)[0], 0) for way in order})
        dist.barrier()
    recovery, _ = fit("auto", RECOVERY_STEPS, args.strategy, pad=True)
    if rank == 0:
        print(f"strategy: {args.strategy}")
        report(rounds, args.steps, recovery)


def report(rounds: list[dict[str, list[float]]], steps: int, recovery: list[tuple[float, float]]) -> None:
    params = sum(p.numel() for p in build_model().parameters())
    print(f"MLP of {params / 1e6:.1f}M parameters, batch {BATCH} per process, {WORLD} CPU processes (gloo),")
    print(f"{len(rounds)} blocks of {steps} steps per way, rotating order, first {SKIP} of each untimed")
    print(f"{'way':10s} {'ms/step':>8s}  (median, rank 0)")
    for way in WAYS:
        print(f"{way:10s} {statistics.median(t for r in rounds for t in r[way]) * 1e3:8.1f}")
    print(f"{'ratio (median of rounds)':26s} {'wall':>6s}  target")
    for way, base, target in (("whole", "off", 1.02), ("auto", "off", 1.02), ("off_again", "off", None)):
        ratio = statistics.median(statistics.median(r[way]) / statistics.median(r[base]) for r in rounds)
        goal = f"<= {target:.2f}: {'met' if ratio <= target else 'NOT met'}" if target else "the noise"
        print(f"{way + ' / ' + base:26s} {ratio:6.3f}  {goal}")

    report_recovery([stamp[0] for stamp in recovery], "one out-of-memory on rank 1", "rank 1 in halves")


def report_recovery(stamps: list[float], what: str, after_what: str, skip: int = SKIP) -> None:
    """The recovery fit's step times: ``stamps[i]`` ends step ``i``, ``RECOVER_AT`` ran out of memory.

    The medians before and after it leave out ``skip`` steps at the start and after the recovery.
    """
    times = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]  # times[i] = step i + 1
    before = statistics.median(times[skip : RECOVER_AT - 1])
    hit = times[RECOVER_AT - 1]
    after = statistics.median(times[RECOVER_AT + skip :])
    print(f"{what} at step {RECOVER_AT} (4 MiB a row filled in forward):")
    print(f"  steps before {before * 1e3:8.3f} ms   the step that recovered {hit * 1e3:8.3f} ms")
    print(f"  recovery costs {(hit - before) * 1e3:8.3f} ms = {hit / before:.2f}x a step")
    print(f"  steady state after ({after_what}) {after * 1e3:8.3f} ms = {after / before:.3f}x before")


if __name__ == "__main__":
    main()
