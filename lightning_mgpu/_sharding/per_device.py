"""What a model sharded by ``mgpu_fsdp``'s plan leaves on each device: one place for the arithmetic.

Each device holds ``1/N`` of every parameter (FSDP2 splits dim 0 and pads it to a multiple of
``N``), of its gradient and of its optimizer state, plus one unit's parameters while they are
gathered. ``estimate_memory`` predicts the ``mgpu_fsdp`` peak with ``shard_share`` and
``unit_bytes``; the strategy and ``choose_strategy`` check the lower bound, ``sharded_need``:
parameters, gradients and the optimizer state where it is counted, activations come on top. When
even that exceeds a device's memory, no setting of the run can work, and the strategy's refusal
(``strategies/fsdp/need.py``'s ``check_fits``) says how many devices would hold it. Tensors on the
meta device count by their shapes, so a model too large to build anywhere is measured too.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from lightning_mgpu._sharding.plan import ShardingPlan

__all__ = [
    "ShardedNeed",
    "fewest_devices",
    "parameter_and_gradient_bytes",
    "parameter_rows",
    "shard_share",
    "sharded_need",
    "unit_bytes",
]

_MOST_DEVICES = 1 << 16  # where fewest_devices stops looking


@dataclass(frozen=True)
class ShardedNeed:
    """Bytes a device needs at least under a sharding plan.

    Attributes:
        state: Parameters, their gradients and the optimizer state when counted, whole model (each
            device holds its shards of it).
        largest_unit: The largest unit's parameters, gathered whole for its forward and backward.
        world: Number of processes the state is sharded over.
        offloaded: Whether the shards live in CPU memory (``cpu_offload=True``).
        optimizer_state: The part of ``state`` that is optimizer state (0: not counted).
        rows: ``parameter_rows`` of the model: the padding of dim 0 weighs on every shard; without
            them the state divides evenly.
    """

    state: int
    largest_unit: int
    world: int
    offloaded: bool = False
    optimizer_state: int = 0
    rows: tuple[tuple[int, int], ...] = ()

    def shards(self, world: int | None = None) -> int:
        """The fullest device's shards of the state over ``world`` processes (default: ``self.world``)."""
        if self.offloaded:
            return 0
        return math.ceil(self.state * shard_share(self.rows, self.world if world is None else world))

    @property
    def per_device(self) -> int:
        """The lower bound for one device."""
        return self.shards() + self.largest_unit

    def devices_needed(self, device_memory: int) -> int | None:
        """The fewest processes whose devices hold this state; ``None`` when no count can."""
        if self.offloaded:
            return 1 if self.largest_unit < device_memory else None
        return fewest_devices(lambda n: self.shards(n) + self.largest_unit <= device_memory)


def fewest_devices(fits: Callable[[int], bool]) -> int | None:
    """The fewest devices ``n`` with ``fits(n)``, for a need that never grows with ``n``; ``None`` when none.

    Past 65536 devices no count is looked for: what is left (a unit gathered whole, the rows FSDP cannot
    split any further) does not shrink.
    """
    if not fits(_MOST_DEVICES):
        return None
    return 1 + bisect.bisect_left(range(1, _MOST_DEVICES + 1), True, key=fits)  # the first count that fits


def unit_bytes(module: nn.Module, plan: ShardingPlan, gather_itemsize: int | None = None) -> list[int]:
    """Bytes of each unit's parameters once gathered: the plan's blocks in order, then the root's rest.

    Args:
        module: The model, before sharding.
        plan: Its sharding plan.
        gather_itemsize: Bytes per number of the gathered parameters (2 under bf16-mixed);
            ``None`` for the parameters' own.
    """

    def gathered(params: Iterable[nn.Parameter]) -> int:
        return sum(p.numel() * (gather_itemsize or p.element_size()) for p in params)

    blocks = [module.get_submodule(name) for name in plan.blocks]
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    rest = [p for p in module.parameters() if id(p) not in in_blocks]  # the root holds the rest
    return [gathered(block.parameters()) for block in blocks] + [gathered(rest)]


def parameter_rows(module: nn.Module, dtype: torch.dtype | None = None) -> tuple[tuple[int, int], ...]:
    """``(rows, bytes per row)`` of each parameter, held once: dim 0 is what FSDP2 splits.

    Args:
        module: The model.
        dtype: The dtype floating-point parameters are kept in (``"bf16-true"``: bfloat16);
            ``None`` for their own.
    """
    out = []
    for p in module.parameters():  # each once: tied weights are listed once
        size = dtype.itemsize if dtype is not None and p.is_floating_point() else p.element_size()
        rows = p.shape[0] if p.dim() else 1
        out.append((rows, p.numel() // rows * size if rows else 0))
    return tuple(out)


def parameter_and_gradient_bytes(module: nn.Module, rows: Iterable[tuple[int, int]]) -> tuple[int, int]:
    """Bytes of the parameters given by ``parameter_rows(module)``, and of the trained ones' gradients."""
    sizes = [n * row for n, row in rows]
    trained = [p.requires_grad for p in module.parameters()]
    return sum(sizes), sum(size for size, trains in zip(sizes, trained, strict=True) if trains)


def shard_share(rows: Iterable[tuple[int, int]], world: int) -> float:
    """The fullest rank's share of the parameters given by ``parameter_rows``, padding included (``1/world``
    without rows): gradients and optimizer state are sharded like their parameters, so the same share.

    FSDP2 splits each parameter's dim 0 into ``world`` chunks of ``ceil(rows / world)`` rows
    (the last padded), so a 33-row weight over 2 ranks takes 17 rows on each.
    """
    rows = tuple(rows)
    whole = sum(n * row for n, row in rows)
    return sum(math.ceil(n / world) * row for n, row in rows) / whole if whole else 1 / world


def sharded_need(
    module: nn.Module,
    plan: ShardingPlan,
    world: int,
    gather_itemsize: int | None = None,
    offloaded: bool = False,
    *,
    param_dtype: torch.dtype | None = None,
    optimizer_state: int = 0,
) -> ShardedNeed:
    """The lower bound of a device's memory for ``module`` sharded by ``plan`` over ``world`` processes.

    Args:
        module: The model, before sharding (meta tensors count by their shape).
        plan: Its sharding plan.
        world: Number of processes.
        gather_itemsize: Bytes per number of the gathered parameters (2 under bf16-mixed);
            ``None`` for the parameters' own.
        offloaded: The shards are kept in CPU memory (``cpu_offload=True``).
        param_dtype: The dtype floating-point parameters are kept in (``bf16-true``: bfloat16);
            ``None`` for their own.
        optimizer_state: Bytes of optimizer state of the whole model
            (``optimizer_state.count_optimizer_state``), sharded like the parameters.
    """
    rows = parameter_rows(module, param_dtype)
    parameters, gradients = parameter_and_gradient_bytes(module, rows)  # a frozen parameter has no gradient
    units = unit_bytes(module, plan, gather_itemsize)
    return ShardedNeed(
        state=parameters + gradients + optimizer_state,
        largest_unit=max(units),
        world=world,
        offloaded=offloaded,
        optimizer_state=optimizer_state,
        rows=rows,
    )
