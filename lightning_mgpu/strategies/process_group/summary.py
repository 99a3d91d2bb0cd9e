"""The start-up summary that rank 0 prints once per run.

It answers what a user of hand-written DDP checks first: how many nodes and processes,
which devices (with names, and physical indices when ``CUDA_VISIBLE_DEVICES`` renumbers
them), which backend, who started the processes, and the per-device and global batch size.
``rank_info`` describes where this process runs; every rank shares it through the store.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence

import torch
from lightning.fabric.plugins.environments import (
    ClusterEnvironment,
    LightningEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)

from lightning_mgpu.devices import cpu_name, visible_cuda_devices
from lightning_mgpu.strategies.process_group.watchdog.verdicts import RankInfo

__all__ = ["format_summary", "launcher_name", "rank_info"]


def rank_info(device: torch.device, rank: int, node_rank: int) -> RankInfo:
    """Where this process runs, as the summary and the watchdog's messages name it."""
    if device.type == "cuda":
        index = device.index or 0
        name = torch.cuda.get_device_name(index)
        visible = visible_cuda_devices()
        if visible is not None and index < len(visible):
            name += f" (physical GPU {visible[index]})"
    elif device.type == "cpu":
        name = cpu_name()
    else:
        name = device.type.upper()
    return RankInfo(
        rank=rank,
        pid=os.getpid(),
        parent_pid=os.getppid(),
        host=socket.gethostname(),
        node_rank=node_rank,
        device=str(device),
        device_name=name,
    )


def launcher_name(environment: ClusterEnvironment | None) -> str:
    """Who started the processes, read from Lightning's cluster environment."""
    if isinstance(environment, TorchElasticEnvironment):
        return "torchrun"
    if isinstance(environment, SLURMEnvironment):
        return "SLURM"
    if isinstance(environment, LightningEnvironment):
        return "Lightning's launcher"
    return type(environment).__name__ if environment is not None else "none"


def format_summary(
    *,
    name: str,
    infos: Mapping[int, RankInfo],
    num_nodes: int,
    processes_per_node: int,
    backend: str,
    launcher: str,
    batch_size: int | None,
    accumulate: int = 1,
    extra_lines: Sequence[str] = (),
) -> str:
    """Several lines: layout, one line per node with its devices, batch sizes, then ``extra_lines``."""
    world = num_nodes * processes_per_node
    lines = [
        f"{name}: {num_nodes} node(s) x {processes_per_node} process(es) per node = {world} process(es),"
        f" backend {backend}, started by {launcher}"
    ]
    nodes: dict[int, list[RankInfo]] = {}
    for info in sorted(infos.values(), key=lambda i: i.rank):
        nodes.setdefault(info.node_rank, []).append(info)
    for node, members in sorted(nodes.items()):
        devices = ", ".join(f"rank {i.rank} {i.device} {i.device_name}" for i in members)
        lines.append(f"  node {node} ({members[0].host}): {devices}")
    if batch_size is not None:
        line = f"  batch size: {batch_size} per device, {batch_size * world} global"
        if accumulate > 1:
            per_step = batch_size * world * accumulate
            line += f" ({per_step} per optimizer step with accumulate_grad_batches={accumulate})"
        lines.append(line)
    lines.extend(f"  {extra}" for extra in extra_lines)
    return "\n".join(lines)
