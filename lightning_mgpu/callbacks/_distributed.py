"""The collectives the callbacks share: every rank's Python object, every rank's numbers in flight."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer

__all__ = ["InFlightGather", "all_gather_objects"]


def all_gather_objects(trainer: Trainer, obj: Any) -> list[Any]:
    """``[obj of rank 0, obj of rank 1, ...]``; ``[obj]`` in a single process (no collective runs).

    Under several processes every rank must call it, in the same order as the other collectives.
    """
    if trainer.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class InFlightGather:
    """One asynchronous all-gather of every rank's rows of numbers at a time, read once training went on.

    ``start`` hands this rank's rows over (every rank the same number of rows and columns) with a ``tag``
    saying what they are; ``finish`` waits for the gather (usually done by then) and gives every rank's
    rows, by rank, and the tag. The monitors start one at a hand-over and finish it at the next, so no
    rank waits for a slower one in between.
    """

    def __init__(self) -> None:
        self._inflight: tuple[Any, list[torch.Tensor], Any] | None = None

    @property
    def pending(self) -> bool:
        return self._inflight is not None

    def start(
        self, rows: list[list[float]], tag: Any, *, device: torch.device | None = None, group: Any = None
    ) -> None:
        mine = torch.tensor(rows, dtype=torch.float64, device=device)
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        self._inflight = (dist.all_gather(parts, mine, group=group, async_op=True), parts, tag)

    def finish(self) -> tuple[list[list[list[float]]], Any] | None:
        """Every rank's rows and the tag of the gather in flight, once it completed; ``None`` when none is."""
        if self._inflight is None:
            return None
        work, parts, tag = self._inflight
        self._inflight = None
        work.wait()
        return [part.cpu().tolist() for part in parts], tag
