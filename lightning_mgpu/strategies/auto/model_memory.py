"""What a model needs of one device, whole and sharded: the fact ``choose_strategy`` weighs it by.

The arithmetic is the estimate's (``lightning_mgpu.estimate.sharded``): parameters and
gradients whole under ``mgpu_ddp``; their shards plus the largest gathered unit under
``mgpu_fsdp``, by its automatic sharding plan. A Trainer precision that converts the
parameters (``bf16-true``, ``16-true``, ``64-true``) counts them at its size; ``bf16-mixed``
gathers the units in bfloat16.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from lightning_mgpu.devices import cuda_devices, format_bytes, parse_bytes
from lightning_mgpu.estimate.shard_plan import plan_sharding
from lightning_mgpu.estimate.sharded import sharded_need
from lightning_mgpu.precision import PRECISIONS
from lightning_mgpu.strategies.fsdp.sharding import mixed_precision_policy

__all__ = ["ModelMemory", "device_memory_of", "model_memory", "shortfall_reason", "sharding_reason"]


@dataclass(frozen=True)
class ModelMemory:
    """What a model needs of one device, whole and sharded, beside what the device has (bytes).

    Attributes:
        whole: Parameters and gradients of the whole model: what ``mgpu_ddp`` puts on each device.
        sharded: Their shards over every process, plus the largest unit gathered (``mgpu_fsdp``).
        device_memory: Memory of one device.
        world: Number of processes the shards are counted over.
        fewest_devices: The fewest processes whose shards fit a device; ``None`` when no count
            can (the largest unit alone does not fit).
    """

    whole: int
    sharded: int
    device_memory: int
    world: int = 1
    fewest_devices: int | None = None

    @property
    def needs_sharding(self) -> bool:
        """A whole copy does not fit one device, the shards do."""
        return self.whole > self.device_memory >= self.sharded

    @property
    def fits_nowhere(self) -> bool:
        """Neither a whole copy nor the shards fit one device."""
        return self.whole > self.device_memory and self.sharded > self.device_memory


def model_memory(model: Any, world: int, device_memory: int, precision: str = "32-true") -> ModelMemory:
    """``ModelMemory`` of ``model`` sharded by ``mgpu_fsdp``'s automatic plan over ``world`` processes.

    Args:
        model: The model (an ``nn.Module``; meta tensors count by their shape). One without
            parameters (its layers are built in ``configure_model``, say) needs nothing yet.
        world: Number of processes.
        device_memory: Memory of one device, in bytes.
        precision: The Trainer's precision: ``bf16-true`` / ``16-true`` count the floating-point
            parameters at 2 bytes (``64-true`` at 8), ``bf16-mixed`` gathers the units at 2 bytes.
    """
    params = {id(p): p for p in model.parameters()}
    if not params:
        return ModelMemory(0, 0, device_memory, world, 1)
    # the dtype a converting precision (bf16-true, 64-true, ...) keeps the parameters in, and the one
    # FSDP gathers them in (bf16-mixed's policy, else the parameters' own)
    converted = PRECISIONS[precision].parameters if precision in PRECISIONS else None
    itemsize = getattr(torch, converted).itemsize if converted else None
    policy = mixed_precision_policy(precision)
    gather = policy.param_dtype.itemsize if policy is not None and policy.param_dtype else itemsize
    need = sharded_need(model, plan_sharding(model), world, gather)
    if itemsize is not None:  # the Trainer converts the floating-point parameters before training
        sizes = (
            p.numel() * (itemsize if p.is_floating_point() else p.element_size()) for p in params.values()
        )
        need = dataclasses.replace(need, state=2 * sum(sizes))
    fewest = need.devices_needed(device_memory)
    return ModelMemory(need.state, need.per_device, device_memory, world, fewest)


def sharding_reason(memory: ModelMemory) -> str:
    """Why ``mgpu_fsdp`` was chosen, with the numbers."""
    return (
        f"the parameters and gradients take {format_bytes(memory.whole)}, more than the"
        f" {format_bytes(memory.device_memory)} of a device, but sharded they need"
        f" {format_bytes(memory.sharded)} per device with the largest unit gathered"
        " (optimizer state and activations come on top)"
    )


def shortfall_reason(memory: ModelMemory) -> str:
    """Why neither ``mgpu_ddp`` nor ``mgpu_fsdp`` can hold the model, with the numbers and what would."""
    if memory.fewest_devices is None:
        fix = (
            "no number of devices helps while its largest unit does not fit: shard smaller blocks"
            " (MGPUFSDPStrategy(block_classes=[...])) or use a lower precision"
        )
    else:
        fix = f"use at least {memory.fewest_devices} devices (devices=, num_nodes=) or a lower precision"
    return (
        f"the model does not fit a device of {format_bytes(memory.device_memory)} even sharded: its"
        f" parameters and gradients take {format_bytes(memory.whole)} whole and"
        f" {format_bytes(memory.sharded)} per device sharded over {memory.world} process(es) with the"
        f" largest unit gathered (optimizer state and activations come on top); {fix}"
    )


def device_memory_of(device_memory: int | str | None, device_type: str) -> int | None:
    """``device_memory`` in bytes; without it the smallest CUDA device's on CUDA, else ``None``."""
    if device_memory is not None:
        return parse_bytes(device_memory)
    totals = [d.total_bytes for d in cuda_devices() if d.total_bytes] if device_type == "cuda" else []
    return min(totals) if totals else None
