"""The first micro-batch size of ``"auto"`` where the device's memory is known: what the estimate says fits.

Without it ``"auto"`` starts with the whole batch and learns from the first out-of-memory; on a
CUDA device, whose memory is known, ``lightning_mgpu.estimate_memory`` (on meta tensors: nothing
is computed or allocated) predicts the largest batch that fits, so a batch far too large for the
card starts in micro-batches that fit instead of failing first. The estimate only sets the start:
out-of-memory errors still halve it, and clean batches still grow it back up to the whole batch.

Under ``mgpu_fsdp`` the model is sharded already: the estimate counts each parameter by its global
shape, runs the step with FSDP's hooks set aside on the units (they would gather parameters, a
collective), and predicts the ``mgpu_fsdp`` peak over the run's processes (shards, the largest unit
gathered, the activations). Activation checkpointing, a hook too, is set aside with them: the
activations are counted whole, so the start errs on the small side there.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_mgpu._compat.torch import hooks_set_aside
from lightning_mgpu._words import counted
from lightning_mgpu.estimate.predict import estimate_memory
from lightning_mgpu.strategies.microbatch.host import MicroBatchHost

if TYPE_CHECKING:
    from lightning_mgpu.estimate.memory_estimate import MemoryEstimate

__all__ = ["estimated_start", "start_from_estimate"]

log = logging.getLogger(__name__)


def start_from_estimate(estimate: MemoryEstimate, rows: int, kind: str, replicas: int = 1) -> int | None:
    """Rows per micro-batch the estimate expects to fit a device; ``None`` when the whole batch does.

    Args:
        estimate: ``estimate_memory``'s result, made with the device's memory.
        rows: the batch's rows on this rank.
        kind: ``"single"``, ``"mgpu_ddp"``, ``"mgpu_fsdp"`` (the estimate made over the run's
            processes) or ``"mgpu_dp"`` (whose micro-batches are split over ``replicas`` devices,
            the first one holding the most).
        replicas: devices one micro-batch is split over (``mgpu_dp``).
    """
    per_device = estimate.largest_per_device_batch(kind)
    fits = per_device * replicas if kind == "mgpu_dp" else per_device
    if fits >= rows:
        return None
    return max(1, fits)


def _kind(strategy: MicroBatchHost) -> tuple[str, int]:
    """The estimate's strategy and the devices it counts: ``mgpu_dp``'s replicas, ``mgpu_fsdp``'s ranks."""
    name = strategy.strategy_name
    if name == "mgpu_dp":
        return name, len(getattr(strategy, "parallel_devices", None) or [None])
    if name == "mgpu_fsdp":
        return name, int(getattr(strategy, "world_size", 1))
    return name if name == "mgpu_ddp" else "single", 1


def estimated_start(
    strategy: MicroBatchHost, module: nn.Module, batch: Any, rows: int, device_memory: int | None = None
) -> int | None:
    """The first micro-batch size for ``batch`` under ``strategy``, or ``None`` for the whole batch.

    ``device_memory`` defaults to the total memory of the strategy's CUDA device; on other devices
    (memory unknown), or when the step cannot run on meta tensors (a precision that autocasts, say),
    the answer is ``None``. A model sharded by ``mgpu_fsdp`` is estimated as the module docstring says.
    """
    device = strategy.root_device
    if device_memory is None:
        if device.type != "cuda":
            return None
        device_memory = torch.cuda.mem_get_info(device)[1]
    kind, replicas = _kind(strategy)
    precision = getattr(strategy.precision_plugin, "precision", None)
    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    try:
        with hooks_set_aside(units):  # FSDP's gathers and reduce-scatters: collectives
            estimate = estimate_memory(
                module,
                batch,
                devices=replicas,
                device_memory=device_memory,
                precision=precision,
                measure_on="meta",
                block_classes=getattr(strategy, "block_classes", None) if units else None,
            )
    except Exception as err:  # the estimate is a hint: without it the whole batch is tried first
        log.debug(
            "no estimate for the first micro-batch size (%s: %s): the whole batch first",
            type(err).__name__,
            err,
        )
        return None
    start = start_from_estimate(estimate, rows, kind, replicas)
    log.info(
        "micro_batch_size='auto': the estimate (%s) says %s of %s fit %s",
        kind,
        "all" if start is None else start,
        counted(rows, "row"),
        device,
    )
    return start
