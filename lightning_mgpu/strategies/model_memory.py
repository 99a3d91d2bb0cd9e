"""What a model needs of one device, whole and sharded: the fact ``choose_strategy`` weighs it by.

The arithmetic is the estimate's (``lightning_mgpu.estimate.sharded``): parameters and
gradients whole under ``mgpu_ddp``; their shards plus the largest gathered unit under
``mgpu_fsdp``, by its automatic sharding plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_mgpu.devices import cuda_devices, format_bytes, parse_bytes
from lightning_mgpu.estimate.shard_plan import plan_sharding
from lightning_mgpu.estimate.sharded import sharded_need

__all__ = ["ModelMemory", "device_memory_of", "model_memory", "sharding_reason"]


@dataclass(frozen=True)
class ModelMemory:
    """What a model needs of one device, whole and sharded, beside what the device has (bytes).

    Attributes:
        whole: Parameters and gradients of the whole model: what ``mgpu_ddp`` puts on each device.
        sharded: Their shards over every process, plus the largest unit gathered (``mgpu_fsdp``).
        device_memory: Memory of one device.
    """

    whole: int
    sharded: int
    device_memory: int

    @property
    def needs_sharding(self) -> bool:
        """A whole copy does not fit one device, the shards do."""
        return self.whole > self.device_memory >= self.sharded


def model_memory(model: Any, world: int, device_memory: int) -> ModelMemory:
    """``ModelMemory`` of ``model`` sharded by ``mgpu_fsdp``'s automatic plan over ``world`` processes."""
    need = sharded_need(model, plan_sharding(model), world)
    return ModelMemory(need.state, need.per_device, device_memory)


def sharding_reason(memory: ModelMemory) -> str:
    """Why ``mgpu_fsdp`` was chosen, with the numbers."""
    return (
        f"the parameters and gradients take {format_bytes(memory.whole)}, more than the"
        f" {format_bytes(memory.device_memory)} of a device, but sharded they need"
        f" {format_bytes(memory.sharded)} per device with the largest unit gathered"
        " (optimizer state and activations come on top)"
    )


def device_memory_of(device_memory: int | str | None, device_type: str) -> int | None:
    """``device_memory`` in bytes; without it the smallest CUDA device's on CUDA, else ``None``."""
    if device_memory is not None:
        return parse_bytes(device_memory)
    totals = [d.total_bytes for d in cuda_devices() if d.total_bytes] if device_type == "cuda" else []
    return min(totals) if totals else None
