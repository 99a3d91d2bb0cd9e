"""FSDP2 over gloo averages gradients exactly on every torch: the probe tells the truth, the fix is exact.

On torch 2.7 and 2.8 gloo's ``reduce_scatter_tensor`` sums when asked to average (pytorch/pytorch#162338);
``make test-compat`` runs this file on torch 2.8 (the ``gloo-sum`` combination) and on the newest torch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_script

SCRIPT = """
import json, sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_mgpu.strategies.fsdp.gloo_average import average_gradients_exactly, reduce_scatter_sums

WORLD = 2


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def batch(rank):
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randn(4, 6, generator=generator), torch.randn(4, 2, generator=generator)


def gradients(net, rank, correct, group):
    fully_shard(net[0], mesh=mesh)
    fully_shard(net, mesh=mesh)
    changed = average_gradients_exactly(net, group) if correct else None
    x, y = batch(rank)
    nn.functional.mse_loss(net(x), y).backward()
    return changed, {n: p.grad.full_tensor() for n, p in net.named_parameters()}


def run(rank, out):
    global mesh
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    group = mesh.get_group()
    sums = reduce_scatter_sums(group)
    _, plain = gradients(model(), rank, False, group)
    changed, corrected = gradients(model(), rank, True, group)
    if rank == 0:
        # one process over both ranks' rows: the mean of their mean losses
        reference = model()
        loss = sum(nn.functional.mse_loss(reference(x), y) for x, y in map(batch, range(WORLD))) / WORLD
        loss.backward()
        expected = {n: p.grad for n, p in reference.named_parameters()}
        ratio = {n: (plain[n] / expected[n]).nanmedian().item() for n in expected}
        error = max((corrected[n] - expected[n]).abs().max().item() for n in expected)
        json.dump({"sums": sums, "changed": changed, "plain_ratio": ratio, "corrected_error": error,
                   "torch": torch.__version__}, open(out, "w"))
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1],), nprocs=WORLD)
"""


@pytest.mark.slow
def test_the_probe_tells_whether_gloo_sums_and_the_gradients_equal_one_process(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    result = run_script(SCRIPT, tmp_path, args=[str(out)], timeout=240)
    assert result.returncode == 0, result.output
    found = json.loads(out.read_text())
    # without a correction FSDP's gradients are the average (1x) or, where gloo sums, 2x one process's
    ratios = set(round(r, 4) for r in found["plain_ratio"].values())
    assert ratios == ({2.0} if found["sums"] else {1.0}), found
    assert found["changed"] is found["sums"]
    assert found["corrected_error"] < 1e-6, found
