"""What a model sharded by ``mgpu_fsdp``'s plan leaves on each device: one place for the arithmetic.

Each device holds ``1/N`` of every parameter (FSDP2 splits dim 0 and pads it to a multiple of
``N``), of its gradient and of its optimizer state, plus one unit's parameters while they are
gathered. ``estimate_memory`` predicts the ``mgpu_fsdp`` peak with ``shard_bytes`` and
``unit_bytes``; the strategy and ``choose_strategy`` check the lower bound, ``sharded_need``:
parameters and gradients only, optimizer state and activations come on top. When even that
exceeds a device's memory, no setting of the run can work, and the error says how many
devices would hold it. Tensors on the meta device count by their shapes, so a model too
large to build anywhere is measured too.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from lightning_mgpu.devices import format_bytes
from lightning_mgpu.estimate.shard_plan import ShardingPlan

__all__ = ["ShardedNeed", "check_fits", "parameter_rows", "shard_bytes", "sharded_need", "unit_bytes"]


@dataclass(frozen=True)
class ShardedNeed:
    """Bytes a device needs at least under a sharding plan.

    Attributes:
        state: Parameters and their gradients, whole model (each device holds 1/N of it).
        largest_unit: The largest unit's parameters, gathered whole for its forward and backward.
        world: Number of processes the state is sharded over.
        offloaded: Whether the shards live in CPU memory (``cpu_offload=True``).
    """

    state: int
    largest_unit: int
    world: int
    offloaded: bool = False

    @property
    def per_device(self) -> int:
        """The lower bound for one device."""
        shards = 0 if self.offloaded else math.ceil(self.state / self.world)
        return shards + self.largest_unit

    def devices_needed(self, device_memory: int) -> int | None:
        """The fewest processes whose devices hold this state; ``None`` when no count can."""
        if device_memory <= self.largest_unit:
            return None
        return 1 if self.offloaded else math.ceil(self.state / (device_memory - self.largest_unit))


def _bytes(module: nn.Module, gather_itemsize: int | None, skip: Collection[int] = ()) -> int:
    size = sum(
        p.numel() * (gather_itemsize or p.element_size()) for p in module.parameters() if id(p) not in skip
    )
    return int(size)


def unit_bytes(module: nn.Module, plan: ShardingPlan, gather_itemsize: int | None = None) -> list[int]:
    """Bytes of each unit's parameters once gathered: the plan's blocks in order, then the root's rest.

    Args:
        module: The model, before sharding.
        plan: Its sharding plan.
        gather_itemsize: Bytes per number of the gathered parameters (2 under bf16-mixed);
            ``None`` for the parameters' own.
    """
    in_blocks: set[int] = set()
    units = []
    for name in plan.blocks:
        block = module.get_submodule(name)
        units.append(_bytes(block, gather_itemsize))
        in_blocks |= {id(p) for p in block.parameters()}
    units.append(_bytes(module, gather_itemsize, skip=in_blocks))  # the root holds the rest
    return units


def parameter_rows(module: nn.Module, dtype: torch.dtype | None = None) -> tuple[tuple[int, int], ...]:
    """``(rows, bytes per row)`` of each parameter, held once: dim 0 is what FSDP2 splits.

    Args:
        module: The model.
        dtype: The dtype floating-point parameters are kept in (``"bf16-true"``: bfloat16);
            ``None`` for their own.
    """
    params = {id(p): p for p in module.parameters()}.values()
    out = []
    for p in params:
        size = dtype.itemsize if dtype is not None and p.is_floating_point() else p.element_size()
        rows = p.shape[0] if p.dim() else 1
        out.append((rows, p.numel() // rows * size if rows else 0))
    return tuple(out)


def shard_bytes(rows: Iterable[tuple[int, int]], world: int) -> int:
    """Bytes of the fullest rank's shards of parameters given by ``parameter_rows``, padding included.

    FSDP2 splits each parameter's dim 0 into ``world`` chunks of ``ceil(rows / world)`` rows
    (the last padded), so a 33-row weight over 2 ranks takes 17 rows on each.
    """
    return sum(math.ceil(n / world) * row for n, row in rows)


def sharded_need(
    module: nn.Module,
    plan: ShardingPlan,
    world: int,
    gather_itemsize: int | None = None,
    offloaded: bool = False,
) -> ShardedNeed:
    """The lower bound of a device's memory for ``module`` sharded by ``plan`` over ``world`` processes.

    Args:
        module: The model, before sharding (meta tensors count by their shape).
        plan: Its sharding plan.
        world: Number of processes.
        gather_itemsize: Bytes per number of the gathered parameters (2 under bf16-mixed);
            ``None`` for the parameters' own.
        offloaded: The shards are kept in CPU memory (``cpu_offload=True``).
    """
    params = {id(p): p for p in module.parameters()}
    state = 2 * sum(p.numel() * p.element_size() for p in params.values())
    units = unit_bytes(module, plan, gather_itemsize)
    return ShardedNeed(state=state, largest_unit=max(units), world=world, offloaded=offloaded)


def check_fits(need: ShardedNeed, device_memory: int, device: str, strategy_name: str = "mgpu_fsdp") -> None:
    """Raise when ``need`` cannot fit ``device_memory``, with the estimate and what would fit.

    Raises:
        ValueError: If the lower bound exceeds the device's memory.
    """
    if need.per_device <= device_memory:
        return
    parts = f"plus {format_bytes(need.largest_unit)} for the largest unit gathered"
    if need.offloaded:
        parts = f"the shards are in CPU memory; {parts}"
    else:
        parts = f"parameters and gradients {format_bytes(need.state)}, 1/{need.world} each, {parts}"
    fewest = need.devices_needed(device_memory)
    if fewest is None:
        fix = (
            "no number of devices helps while one unit does not fit: shard smaller blocks"
            " (block_classes=[...]) or use a lower precision"
        )
    else:
        fix = f"use at least {fewest} devices (devices=, num_nodes=), cpu_offload=True or a lower precision"
    raise ValueError(
        f"{strategy_name}: the model needs at least {format_bytes(need.per_device)} per device on"
        f" {need.world} process(es) ({parts}; optimizer state and activations come on top), but {device} has"
        f" {format_bytes(device_memory)}. {fix[0].upper()}{fix[1:]}."
    )
