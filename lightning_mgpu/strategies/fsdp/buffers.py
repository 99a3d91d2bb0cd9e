"""FSDP's own collectives, watched: an out-of-memory in their buffers never leaves a rank waiting.

Before each collective FSDP2 allocates a buffer of its own: the gathered parameters of a unit
before its all-gather, the gradients to reduce-scatter before that. A rank that runs out of memory
there stops before the collective the other ranks have already entered. Where torch lets a strategy
give FSDP its collectives (``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``),
``watch_buffers`` gives every unit FSDP's own, wrapped:

- an out-of-memory allocating a buffer says which buffer (the unit, the collective, the bytes) and
  is raised as it is; right before each collective every rank passes a checkpoint (``check``: under
  ``micro_batch_size="auto"`` the ``SyncPoints`` checkpoint, one small all-reduce). The rank that
  failed meets the others there from its agreement, so every rank abandons the pass before the
  collective and runs the batch again in smaller micro-batches: recovered. Without ``"auto"`` the
  error ends the run, and the watchdog stops the other ranks within seconds;
- an out-of-memory inside the collective itself (gloo's own temporaries on CPU) leaves the other ranks
  inside it: it becomes ``CollectiveOutOfMemoryError``, which nothing retries, and the watchdog stops
  every rank within seconds, the error naming the collective.

On a torch without these methods FSDP's collectives run as they are.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_mgpu.devices import format_bytes
from lightning_mgpu.oom import is_out_of_memory
from lightning_mgpu.strategies.process_group.errors import add_to_message

__all__ = ["CollectiveOutOfMemoryError", "Watched", "watch_buffers"]

log = logging.getLogger(__name__)


class CollectiveOutOfMemoryError(Exception):
    """Out of memory inside one of FSDP's collectives, which the other ranks had entered: the run stops.

    Not an out-of-memory to ``is_out_of_memory``: micro-batching must not run the batch again while
    the other ranks wait in the collective. The out-of-memory is its ``__cause__``.
    """


def _nothing() -> None:
    """No checkpoint: no ``SyncPoints`` watches the model."""


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class _WatchedCollective:
    """FSDP's all-gather or reduce-scatter of one unit, its buffers and its call watched (see the module)."""

    def __init__(self, inner: Any, what: str, check: Callable[[], None]) -> None:
        self.inner = inner
        self.what = what
        self.check = check

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        try:
            return self.inner.allocate(size, dtype=dtype, device=device)
        except BaseException as error:
            if is_out_of_memory(error):
                nbytes = format_bytes(math.prod(int(s) for s in size) * dtype.itemsize)
                line = f"[rank {_rank()}] out of memory allocating {nbytes} for mgpu_fsdp's {self.what}"
                log.warning("%s", line)
                add_to_message(error, line)
            raise

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.check()  # every buffer is allocated: the ranks meet before any enters the collective
        try:
            return self.inner(*args, **kwargs)
        except BaseException as error:
            if not is_out_of_memory(error):
                raise
            first = (str(error).strip().splitlines() or [""])[0]
            raise CollectiveOutOfMemoryError(
                f"[rank {_rank()}] out of memory inside mgpu_fsdp's {self.what}, which the other ranks had"
                f" entered, so the batch cannot run again in smaller micro-batches ({first}). FSDP's buffers"
                " grow with its units, not with the batch: shard smaller units"
                " (MGPUFSDPStrategy(block_classes=[...])), gather in bfloat16 (precision='bf16-mixed'), or"
                " leave room for them (a smaller batch or micro_batch_size)"
            ) from error


def _unit_name(name: str) -> str:
    return f"unit {name!r}" if name else "the root unit"  # named_modules' name of the root is ""


class Watched(NamedTuple):
    """What ``watch_buffers`` did: the units whose collectives it watches, and those it cannot watch."""

    watched: int
    unwatched: int
    """Units that gather parameters but whose collectives torch does not let a strategy give (an older
    torch, a unit with several parameter groups)."""


def watch_buffers(root: nn.Module, check: Callable[[], None] | None = None) -> Watched:
    """Give every FSDP unit of ``root`` FSDP's own collectives, watched; ``check`` runs before each one.

    Called again, it keeps the units' watched collectives; a ``check`` replaces theirs (``None`` keeps
    it: none at first). ``SyncPoints`` gives its checkpoint while it exists.
    """
    watched = unwatched = 0
    for name, unit in root.named_modules():
        if not isinstance(unit, FSDPModule):
            continue
        set_gather = getattr(unit, "set_custom_all_gather", None)
        set_reduce = getattr(unit, "set_custom_reduce_scatter", None)
        get_state = getattr(unit, "_get_fsdp_state", None)
        if set_gather is None or set_reduce is None or get_state is None:
            unwatched += 1
            continue
        # FSDP's own collectives are read from its parameter group (no public getter), to be wrapped
        groups = getattr(get_state(), "_fsdp_param_groups", None) or []
        if len(groups) != 1:
            unwatched += len(groups) > 1  # none: nothing to gather; several: a grouping set_custom_* refuses
            continue
        group = groups[0]
        for attribute, setter, what in (
            ("_all_gather_comm", set_gather, f"all-gather of the parameters of {_unit_name(name)}"),
            ("_reduce_scatter_comm", set_reduce, f"reduce-scatter of the gradients of {_unit_name(name)}"),
        ):
            comm = getattr(group, attribute, None)
            if comm is None:
                unwatched += 1
                break
            if isinstance(comm, _WatchedCollective):
                comm.check = check or comm.check
            else:
                setter(_WatchedCollective(comm, what, check or _nothing))
        else:
            watched += 1
    log.debug("FSDP's collectives watched on %d unit(s), not on %d", watched, unwatched)
    return Watched(watched, unwatched)
