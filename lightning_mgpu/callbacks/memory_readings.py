"""What ``DeviceMemoryMonitor`` reads in one process, and how: the plan fixed for a fit, then readings.

- ``plan_readings`` decides once per fit which devices this process reads: its CUDA device (or,
  under ``mgpu_dp``, every replica's), its CPU process, and under ``mgpu_dp`` on CPU each replica's
  bytes saved for backward (the replicas are threads of one process and share its RSS);
- ``take_readings`` reads them, as plain ``Reading`` records (``memory_report.py``); the rank's
  first device also carries the bytes of parameters, gradients and optimizer state the rank holds
  (``measure_model_state``: the local shards under ``mgpu_fsdp``, whole tensors otherwise; measured
  again only when a tensor appeared or went, ``ModelStateMeter``);
- ``micro_batch_sizes`` gathers the rows per micro-batch each rank's last batch ran in, at the end
  of a fit, under a strategy that runs micro-batches (``micro_batch_size=``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from lightning.pytorch import Trainer

from lightning_mgpu.callbacks._distributed import all_gather_objects
from lightning_mgpu.callbacks.memory_report import Reading
from lightning_mgpu.devices import allocator_memory, nvml_memory, process_memory
from lightning_mgpu.estimate.model_state import ModelStateMeter

__all__ = [
    "PlannedReading",
    "device_label",
    "micro_batch_sizes",
    "plan_readings",
    "replica_devices",
    "strategy_kind",
    "take_readings",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlannedReading:
    """One device this process reads at every log of a fit."""

    label: str
    """The device's name in metrics, e.g. ``cuda:0``, ``cpu:rank1``, ``cpu:replica0``."""
    kind: str
    """``"cuda"``, ``"cpu"`` (a process) or ``"replica"`` (a CPU ``mgpu_dp`` replica)."""
    device: torch.device
    name: str
    """What the table shows: the GPU's name, ``CPU process`` or ``CPU replica``."""
    index: int | None
    """Which of this process's devices it is (its rows are that device's batch); ``None`` for the
    process that ``mgpu_dp``'s replicas share."""


def replica_devices(trainer: Trainer) -> list[torch.device]:
    """The devices of a single-process data-parallel strategy (``mgpu_dp``); empty for any other."""
    try:
        return list(getattr(trainer.strategy, "replica_devices", None) or [])
    except RuntimeError:  # a strategy without devices yet
        return []


def strategy_kind(trainer: Trainer) -> str:
    """``"mgpu_dp"`` (replicas in one process), ``"ddp"`` (several processes) or ``"single"``."""
    if replica_devices(trainer):
        return "mgpu_dp"
    return "ddp" if trainer.world_size > 1 else "single"


def device_label(trainer: Trainer, device: torch.device) -> str:
    """``cuda:1``; ``node<n>:cuda:1`` when the run spans several machines."""
    label = f"{device.type}:{device.index or 0}"
    return f"node{trainer.node_rank}:{label}" if trainer.num_nodes > 1 else label


def plan_readings(trainer: Trainer) -> list[PlannedReading]:
    """What this process reads at each log, fixed for the fit."""
    replicas = replica_devices(trainer)
    devices = replicas or [trainer.strategy.root_device]
    plan = []
    if any(d.type == "cpu" for d in devices):
        # under mgpu_dp the process is shared by every replica; otherwise it is rank's one device
        label = f"cpu:rank{trainer.global_rank}"
        plan.append(PlannedReading(label, "cpu", torch.device("cpu"), "CPU process", None if replicas else 0))
    for i, device in enumerate(devices):
        if device.type == "cuda":
            name = torch.cuda.get_device_name(device)
            plan.append(PlannedReading(device_label(trainer, device), "cuda", device, name, i))
        elif replicas and device.type == "cpu":
            plan.append(PlannedReading(f"cpu:replica{i}", "replica", device, "CPU replica", i))
    log.debug(
        "rank %d reads %s (%s)",
        trainer.global_rank,
        ", ".join(p.label for p in plan),
        "mgpu_dp replicas in this process" if replicas else "this process's device",
    )
    return plan


def take_readings(
    trainer: Trainer, plan: list[PlannedReading], rows: int | None, reset_peak: bool, meter: ModelStateMeter
) -> list[Reading]:
    """Read every planned device now; ``rows`` is the batch this process got in the last step.

    ``meter`` measures the model state (keep one per fit, so that a step whose parameters, gradients
    and optimizer state kept their sizes is not measured again)."""
    strategy = trainer.strategy
    chunks = getattr(strategy, "last_chunk_sizes", None) or []
    module = trainer.lightning_module
    state = meter(module, trainer.optimizers).local.total if module is not None else math.nan
    readings = []
    for item in plan:
        if item.index is None:
            device_rows = math.nan
        elif chunks:  # replicas beyond the chunks got no rows (a batch smaller than the device count)
            device_rows = chunks[item.index] if item.index < len(chunks) else 0
        else:
            device_rows = rows if rows is not None else math.nan
        values: dict[str, float]
        if item.kind == "replica":  # threads of one process: what each saved for backward
            saved = getattr(strategy, "replica_saved_bytes", None) or []
            index = item.index or 0
            values = {"saved": saved[index] if index < len(saved) else math.nan}
        elif item.kind == "cpu":
            values = dict(process_memory())
        else:
            nvml = nvml_memory(item.device)
            used, total = nvml or (math.nan, torch.cuda.get_device_properties(item.device).total_memory)
            values = {**allocator_memory(item.device, reset_peak), "nvml_used": used, "total": total}
        if item.kind != "replica":  # the rank's model state, on its first device (the process's)
            values["model_state"] = state if item.index in (0, None) else math.nan
        readings.append(Reading(item.label, item.kind, trainer.global_rank, item.name, values, device_rows))
    return readings


def micro_batch_sizes(trainer: Trainer) -> dict[int, int | None]:
    """Rank -> rows per micro-batch its last batch ran in (``None``: whole); empty without micro-batches.

    What ran, not the rank's setting: under ``mgpu_fsdp`` a rank runs as many micro-batches as the
    rank that needs most, so one that never ran out of memory may run smaller ones than its own.
    Under several processes every rank must call it (one all-gather); each reaches the same answer
    whether to gather, as the setting is the same on every rank.
    """
    strategy = trainer.strategy
    sizes = getattr(strategy, "micro_batches", None)
    if sizes is None or getattr(strategy, "micro_batch_size", None) is None:
        return {}
    everyone = all_gather_objects(trainer, (trainer.global_rank, sizes.last_rows))
    log.debug("micro-batch sizes at the end of fit: %s", everyone)
    return dict(everyone)
