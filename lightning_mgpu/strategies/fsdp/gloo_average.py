"""Gradients averaged exactly over gloo: a probe at setup; FSDP sums and divides where gloo's average sums.

FSDP2 reduce-scatters fp32 and bf16 gradients with ``ReduceOp.AVG``. On torch 2.7 and 2.8, gloo's
``reduce_scatter_tensor`` ignores the op and sums (pytorch/pytorch#162338, "Incorrect AVG reduction for
GLOO"), so every gradient comes out world-size times too large, silently. Fixed in torch 2.9: delete this
module once the floor in ``pyproject.toml`` reaches 2.9.

- ``reduce_scatter_sums``: one AVG ``reduce_scatter_tensor`` of one element per rank on the real group
  tells whether this torch's gloo averages (only gloo is probed: NCCL's AVG is its own).
- ``average_gradients_exactly``: where it sums, every FSDP unit reduces with ``ReduceOp.SUM`` and divides
  by the world size itself (``FSDPModule.set_force_sum_reduction_for_comms``, torch 2.8); on a torch
  without it (2.7) the run is refused in one line naming the torch it needs. Where it averages (torch
  2.9 up, NCCL), nothing changes: the same division there would halve the gradients of two ranks.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_mgpu._compat.torch import FSDP_FORCE_SUM, require

__all__ = ["average_gradients_exactly", "reduce_scatter_sums"]

log = logging.getLogger(__name__)


def reduce_scatter_sums(group: dist.ProcessGroup) -> bool:
    """Whether ``group``'s ``reduce_scatter_tensor`` sums when asked to average (gloo on torch 2.7, 2.8).

    A collective: every rank of ``group`` calls it. One process, or a backend other than gloo: ``False``
    without communicating.
    """
    world = dist.get_world_size(group)
    if world == 1 or dist.get_backend(group) != dist.Backend.GLOO:
        return False
    averaged = torch.zeros(1)
    dist.reduce_scatter_tensor(averaged, torch.ones(world), op=dist.ReduceOp.AVG, group=group)
    return averaged.item() != 1.0  # the average of ones is 1; the bug gives the sum, world


def average_gradients_exactly(model: nn.Module, group: dist.ProcessGroup) -> bool:
    """Make ``model``'s FSDP units average gradients exactly over ``group``; ``True`` if it changed them.

    - probe ``group`` (``reduce_scatter_sums``): an average that averages needs nothing;
    - one that sums: every unit reduces with SUM and divides by the world size after the reduce-scatter
      (``set_force_sum_reduction_for_comms(True)``), what FSDP does for fp16 gradients anyway.

    Raises:
        RuntimeError: The average sums and this torch cannot make FSDP sum instead (torch 2.7).
    """
    if not reduce_scatter_sums(group):
        return False
    require(FSDP_FORCE_SUM)
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_force_sum_reduction_for_comms(True)
    log.debug(
        "gloo's reduce_scatter_tensor sums when asked to average (pytorch/pytorch#162338, torch %s):"
        " %d FSDP units reduce with SUM and divide by %d instead",
        torch.__version__,
        len(units),
        dist.get_world_size(group),
    )
    return True
