"""FSDP2 over gloo on two spawned processes: does gloo sum when asked to average, and is the fix exact?

Usage: ``python gloo_average.py OUT.json`` (tests/strategies/fsdp/test_gloo_average.py). Rank 0 writes
the probe's answer, the plain gradients' ratio to one process's and the corrected gradients' error.
"""

from __future__ import annotations

import json
import sys
from typing import cast

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_mgpu.strategies.fsdp.gloo_average import average_gradients_exactly, reduce_scatter_sums

WORLD = 2


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randn(4, 6, generator=generator), torch.randn(4, 2, generator=generator)


def gradients(
    net: nn.Sequential, rank: int, correct: bool, mesh: DeviceMesh
) -> tuple[bool | None, dict[str, torch.Tensor]]:
    fully_shard(net[0], mesh=mesh)
    fully_shard(net, mesh=mesh)
    changed = average_gradients_exactly(net, mesh.get_group()) if correct else None
    x, y = batch(rank)
    nn.functional.mse_loss(net(x), y).backward()
    return changed, {n: p.grad.full_tensor() for n, p in net.named_parameters()}  # type: ignore[union-attr]


def run(rank: int, out: str) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    sums = reduce_scatter_sums(mesh.get_group())
    _, plain = gradients(model(), rank, False, mesh)
    changed, corrected = gradients(model(), rank, True, mesh)
    if rank == 0:
        # one process over both ranks' rows: the mean of their mean losses
        reference = model()
        loss = sum(nn.functional.mse_loss(reference(x), y) for x, y in map(batch, range(WORLD))) / WORLD
        loss.backward()  # type: ignore[union-attr]
        expected = {n: cast(torch.Tensor, p.grad) for n, p in reference.named_parameters()}
        ratio = {n: (plain[n] / expected[n]).nanmedian().item() for n in expected}
        error = max((corrected[n] - expected[n]).abs().max().item() for n in expected)
        found = {"sums": sums, "changed": changed, "plain_ratio": ratio, "corrected_error": error}
        with open(out, "w") as f:
            json.dump({**found, "torch": torch.__version__}, f)
    # rank 1 would otherwise tear gloo down while rank 0 still computes: "terminate called without an
    # active exception" (SIGABRT) in rank 1, seen once under a full suite
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1],), nprocs=WORLD)
