"""Step time of ``micro_batch_size="auto"`` on CUDA with no out-of-memory, and what one recovery costs.

Usage::

    python benchmarks/microbatch_gpu.py                 # every visible GPU, a minute or two
    python benchmarks/microbatch_gpu.py --width 1024 --batch 32   # a launch-bound step: the worst case

An MLP (``--layers`` layers of ``--width``) trains on ``--batch`` rows per GPU under ``mgpu_ddp``
(NCCL, one process per GPU), three ways that take turns in blocks, in a rotating order:

- ``off``: ``MGPUDDPStrategy()``, no micro-batching;
- ``auto``: ``micro_batch_size="auto"`` with nothing running out of memory (on CUDA its first
  size comes from ``estimate_memory``, run once on meta tensors);
- ``off_again``: ``off`` once more, to show the noise.

Each block synchronizes the GPU before its first timed step and after its last, so a block's time
per step counts every host sync ``"auto"`` adds. Rank 0 prints the median over blocks of the
time per step and the median of the per-round ratios (target: ``auto`` <= 1.02x ``off``).

Then one ``auto`` fit, synchronized after every step, whose forward also fills ``PAD_MIB`` MiB per
row for a moment, in which rank 0 runs out of CUDA memory for real at step ``RECOVER_AT``: its
caching allocator is emptied and limited (``torch.cuda.set_per_process_memory_fraction``) to what
the step before reserved, less a quarter of the batch's fill, for that step; printed are that step's
time beside the median step before it, and the steady state after it (in micro-batches of half the
batch).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from microbatch import RECOVER_AT, report_recovery
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mgpu import MGPUDDPStrategy

WAYS = ("off", "auto", "off_again")
SKIP = 5
"""Steps at the start of each block that are not timed (cuBLAS and allocator warm-up)."""
RECOVERY_STEPS = 40
PAD_MIB = 4


class Blocks(L.Callback):
    """Wall time of the steps after the first ``SKIP`` of a fit, the GPU synchronized at both ends.

    ``each_step``: the GPU is synchronized after every step too, so ``stamps`` time single steps.
    """

    def __init__(self, each_step: bool = False) -> None:
        self.each_step = each_step
        self.start = self.end = 0.0
        self.steps = 0
        self.stamps: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.each_step or trainer.global_step == SKIP:
            torch.cuda.synchronize()
        if trainer.global_step == SKIP:
            self.start = time.perf_counter()
        self.stamps.append(time.perf_counter())

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        torch.cuda.synchronize()
        self.end = time.perf_counter()
        self.steps = trainer.global_step - SKIP

    def per_step(self) -> float:
        return (self.end - self.start) / self.steps


class Regression(L.LightningModule):
    def __init__(self, width: int, layers: int, pad: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        blocks = [m for _ in range(layers) for m in (nn.Linear(width, width), nn.GELU())]
        self.net = nn.Sequential(*blocks, nn.Linear(width, 1))
        self.pad = pad
        self._reserved = 0

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if not self.pad or self.global_rank != 0:
            return
        step = self.trainer.global_step
        if step == RECOVER_AT:  # what the last step reserved, less a quarter of the batch's fill
            self._reserved = torch.cuda.memory_reserved(self.device)
            torch.cuda.empty_cache()
            total = torch.cuda.get_device_properties(self.device).total_memory
            allowed = self._reserved - len(batch[0]) * PAD_MIB * 2**20 // 4
            torch.cuda.set_per_process_memory_fraction(allowed / total, self.device)
        elif step == RECOVER_AT + 1:
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.pad:
            with torch.no_grad():
                x.new_empty(len(x), PAD_MIB * 2**18).fill_(1.0)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def fit(args: argparse.Namespace, way: str, steps: int, pad: bool = False) -> tuple[Blocks, int]:
    blocks = Blocks(each_step=pad)
    trainer = L.Trainer(
        accelerator="gpu",
        devices=args.devices,
        strategy=MGPUDDPStrategy(micro_batch_size="auto" if way == "auto" else None),
        max_steps=steps,
        callbacks=[blocks],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    rows = steps * args.batch * trainer.world_size
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(rows, args.width, generator=g), torch.randn(rows, 1, generator=g))
    loader = DataLoader(data, batch_size=args.batch, pin_memory=True)
    trainer.fit(Regression(args.width, args.layers, pad), loader)
    return blocks, trainer.global_rank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="steps per block (default: 40)")
    parser.add_argument("--rounds", type=int, default=8, help="blocks of each way (default: 8)")
    parser.add_argument("--devices", type=int, default=-1, help="GPUs (default: every visible one)")
    parser.add_argument("--width", type=int, default=4096, help="MLP width (default: 4096)")
    parser.add_argument("--layers", type=int, default=4, help="hidden layers (default: 4)")
    parser.add_argument("--batch", type=int, default=256, help="rows per GPU (default: 256)")
    args = parser.parse_args()
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)

    _, rank = fit(args, "off", SKIP + 2)  # starts the other processes and the group; not timed
    rounds: list[dict[str, float]] = []
    for index in range(args.rounds):
        order = WAYS[index % len(WAYS) :] + WAYS[: index % len(WAYS)]
        rounds.append({way: fit(args, way, SKIP + args.steps)[0].per_step() for way in order})
        dist.barrier()
    recovery, _ = fit(args, "auto", RECOVERY_STEPS, pad=True)
    if rank == 0:
        report(args, rounds, recovery.stamps)


def report(args: argparse.Namespace, rounds: list[dict[str, float]], stamps: list[float]) -> None:
    params = sum(p.numel() for p in Regression(args.width, args.layers).parameters())
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {dist.get_world_size()} process(es)")
    print(f"MLP of {params / 1e6:.1f}M parameters, batch {args.batch} per GPU, fp32")
    print(f"{len(rounds)} blocks of {args.steps} timed steps per way, rotating order")
    print(f"{'way':10s} {'ms/step':>8s}  (median of blocks, rank 0)")
    for way in WAYS:
        print(f"{way:10s} {statistics.median(r[way] for r in rounds) * 1e3:8.3f}")
    for way, target in (("auto", 1.02), ("off_again", None)):
        ratio = statistics.median(r[way] / r["off"] for r in rounds)
        goal = f"<= {target:.2f}: {'met' if ratio <= target else 'NOT met'}" if target else "the noise"
        print(f"{way + ' / off':26s} {ratio:6.3f}  {goal}")

    report_recovery(stamps, "one CUDA out-of-memory on rank 0", "in halves", SKIP)


if __name__ == "__main__":
    main()
