"""The collective the callbacks share: every rank's Python object, on every rank."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning.pytorch import Trainer

__all__ = ["all_gather_objects"]


def all_gather_objects(trainer: Trainer, obj: Any) -> list[Any]:
    """``[obj of rank 0, obj of rank 1, ...]``; ``[obj]`` in a single process (no collective runs).

    Under several processes every rank must call it, in the same order as the other collectives.
    """
    if trainer.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
