"""Model state per process and time per step of ``mgpu_fsdp`` beside ``mgpu_ddp``, same model, same processes.

Usage::

    python benchmarks/fsdp.py                   # 2 CPU processes (gloo), a few minutes
    python benchmarks/fsdp.py --rounds 6 --steps 30

A 6-block residual MLP (3.7M parameters) trains with AdamW in the same two CPU processes under
``mgpu_ddp`` and ``mgpu_fsdp``, in alternating blocks of steps so that the load of a
shared machine hits both alike. Each rank measures, after an optimizer step, the bytes of
parameters, gradients and AdamW state it holds (``lightning_mgpu.strategies.fsdp.
measure_model_state``: the local shards under FSDP, whole tensors under DDP); rank 0 records
the wall time of each step but the first few of each block. Printed: each rank's model
state under both strategies and their ratio (target: ``mgpu_fsdp`` <= 0.55x ``mgpu_ddp``
at 2 processes), and the median step times and their ratio (reported, no target: on CPU,
gloo's all-gathers make FSDP slower; on GPUs NCCL overlaps them with compute).
Lightning's launcher starts the second process by running this script again.
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
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mgpu  # noqa: F401  registers mgpu_ddp and mgpu_fsdp
from lightning_mgpu.devices import format_bytes
from lightning_mgpu.estimate.model_state import StateBytes, measure_model_state

WAYS = ("mgpu_ddp", "mgpu_fsdp")
WORLD = 2
BATCH = 32
WIDTH, BLOCKS = 384, 6
SKIP = 3
"""Steps at the start of each block that are not timed (lazy initialisation, allocator warm-up)."""


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block() for _ in range(BLOCKS)))
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class Measure(L.Callback):
    """Step end times, and the model state this rank holds after its second step."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.state: StateBytes | None = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.stamps.append(time.perf_counter())
        if trainer.global_step == 2 and self.state is None:  # gradients and AdamW state exist
            self.state = measure_model_state(pl_module, trainer.optimizers).local


def build_data(steps: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    n = steps * BATCH * WORLD
    x = torch.randn(n, WIDTH, generator=generator)
    return TensorDataset(x, torch.randn(n, WIDTH, generator=generator))


def run_block(strategy: str, steps: int) -> tuple[list[float], StateBytes | None]:
    torch.manual_seed(0)
    measure = Measure()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_steps=steps,
        callbacks=[measure],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regression(), DataLoader(build_data(steps), batch_size=BATCH))
    times = [b - a for a, b in zip(measure.stamps[SKIP:], measure.stamps[SKIP + 1 :], strict=False)]
    return times, measure.state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per block (default: 20)")
    parser.add_argument("--rounds", type=int, default=4, help="blocks of each strategy (default: 4)")
    args = parser.parse_args()
    for name in ("lightning.pytorch", "lightning.fabric"):  # one summary, not one per block
        logging.getLogger(name).setLevel(logging.WARNING)

    times: dict[str, list[float]] = {way: [] for way in WAYS}
    ratios: list[float] = []  # per round: the two blocks ran seconds apart
    states: dict[str, StateBytes | None] = {}
    for round_index in range(args.rounds):
        order = WAYS if round_index % 2 == 0 else WAYS[::-1]
        medians = {}
        for way in order:
            block, states[way] = run_block(way, args.steps)
            times[way] += block
            medians[way] = statistics.median(block)
        ratios.append(medians["mgpu_fsdp"] / medians["mgpu_ddp"])
    gathered: list[dict[str, StateBytes | None]] = [{} for _ in range(WORLD)]
    dist.all_gather_object(gathered, states)
    if dist.get_rank() == 0:
        report(gathered, times, ratios, args.steps)


def report(
    states: list[dict[str, StateBytes | None]], times: dict[str, list[float]], ratios: list[float], steps: int
) -> None:
    params = sum(p.numel() for p in Regression().parameters())
    print(f"MLP of {BLOCKS} residual blocks, {params / 1e6:.1f}M parameters, AdamW, {BATCH} rows per process")
    print(f"{WORLD} CPU processes (gloo), {len(ratios)} blocks of {steps} steps per strategy, alternating")
    print(f"{'model state per rank':22s} {'params':>10s} {'grads':>10s} {'AdamW':>10s} {'total':>10s}")
    for rank, state in enumerate(states):
        for way in WAYS:
            s = state[way]
            assert s is not None
            cells = (s.parameters, s.gradients, s.optimizer, s.total)
            print(f"rank {rank} {way:16s} " + " ".join(f"{format_bytes(c):>10s}" for c in cells))
    for rank, state in enumerate(states):
        fsdp, ddp = state["mgpu_fsdp"], state["mgpu_ddp"]
        assert fsdp is not None
        assert ddp is not None
        ratio = fsdp.total / ddp.total
        met = "met" if ratio <= 0.55 else "NOT met"
        print(f"rank {rank}: model state mgpu_fsdp / mgpu_ddp = {ratio:.3f}  (target <= 0.55: {met})")
    for way in WAYS:
        print(f"{way:10s} {statistics.median(times[way]) * 1e3:8.1f} ms/step (median, rank 0)")
    print(f"step time mgpu_fsdp / mgpu_ddp = {statistics.median(ratios):.2f} (median of per-round ratios)")


if __name__ == "__main__":
    main()
