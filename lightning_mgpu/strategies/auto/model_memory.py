"""What a model needs of one device, whole and sharded: the fact ``choose_strategy`` weighs it by.

The numbers are the estimate's (``lightning_mgpu.estimate.predict.model_state_estimate``, whose peaks
``estimate_memory`` reports too): under ``mgpu_ddp`` the peak of a whole copy, the optimizer step's (the
parameters, their gradients, DDP's gradient buckets, the optimizer state and the temporaries the step
allocates beside it) or the backward's where larger; under ``mgpu_fsdp`` the fullest device's shards of
them plus the largest unit of its automatic sharding plan gathered. The optimizer state is what one step
of the model's ``configure_optimizers()`` creates, counted on meta tensors by the counter
``estimate_memory`` uses (``optimizer_state.py``), its temporaries by a second step. A Trainer precision
that converts the parameters (``bf16-true``, ``16-true``, ``64-true``) counts them, their gradients and
their state at its size; ``bf16-mixed`` gathers the units in bfloat16. Activations come on top: they
need a batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_mgpu._words import counted
from lightning_mgpu.devices import format_bytes
from lightning_mgpu.estimate.optimizer_state import OptimizerState
from lightning_mgpu.estimate.predict import model_state_estimate
from lightning_mgpu.strategies.fsdp.need import count_state

__all__ = [
    "ModelMemory",
    "fitting_reason",
    "model_memory",
    "sharding_reason",
    "shortfall_reason",
]


@dataclass(frozen=True)
class ModelMemory:
    """What a model needs of one device, whole and sharded, beside what the device has (bytes).

    Attributes:
        whole: The peak of ``mgpu_ddp`` on each device before any activation: parameters, gradients,
            DDP's gradient buckets, optimizer state and its step's temporaries.
        sharded: The peak under ``mgpu_fsdp``: the fullest device's shards of the parameters, gradients,
            optimizer state and its step's temporaries, or the shards plus the largest unit gathered.
        device_memory: Memory of one device.
        world: Number of processes the shards are counted over.
        fewest_devices: The fewest processes whose shards fit a device; ``None`` when no count
            can (the largest unit alone does not fit).
        optimizer: The optimizer state counted in both (``bytes`` 0 and a ``note`` when it is not).
    """

    whole: int
    sharded: int
    device_memory: int
    world: int = 1
    fewest_devices: int | None = None
    optimizer: OptimizerState = field(default_factory=lambda: OptimizerState(0))

    @property
    def needs_sharding(self) -> bool:
        """A whole copy does not fit one device, the shards do."""
        return self.whole > self.device_memory >= self.sharded

    @property
    def fits_nowhere(self) -> bool:
        """Neither a whole copy nor the shards fit one device."""
        return self.whole > self.device_memory and self.sharded > self.device_memory


def model_memory(
    model: Any,
    world: int,
    device_memory: int,
    precision: str = "32-true",
    optimizer: torch.optim.Optimizer | None = None,
) -> ModelMemory:
    """``ModelMemory`` of ``model`` and its optimizer, sharded by ``mgpu_fsdp``'s plan over ``world`` ranks.

    Args:
        model: The model (an ``nn.Module``; meta tensors count by their shape). One without
            parameters (its layers are built in ``configure_model``, say) needs nothing yet.
        world: Number of processes.
        device_memory: Memory of one device, in bytes.
        precision: The Trainer's precision: ``bf16-true`` / ``16-true`` count the floating-point
            parameters, gradients and optimizer state at 2 bytes (``64-true`` at 8), ``bf16-mixed``
            gathers the units at 2 bytes.
        optimizer: The optimizer over ``model``'s parameters; ``None`` uses ``model.configure_optimizers()``.
    """
    if next(iter(model.parameters()), None) is None:
        return ModelMemory(0, 0, device_memory, world, 1)
    state, _ = count_state(model, precision, optimizer)
    estimate = model_state_estimate(
        model, state, devices=world, device_memory=device_memory, precision=precision
    )
    whole = estimate.peak("mgpu_ddp", per_device_batch=0)
    sharded = estimate.peak("mgpu_fsdp", per_device_batch=0)
    fewest = estimate.devices_to_fit(per_device_batch=0)
    return ModelMemory(whole, sharded, device_memory, world, fewest, state)


def _contents(memory: ModelMemory) -> str:
    if memory.optimizer.bytes:
        return f"parameters, gradients and optimizer state ({memory.optimizer.optimizer})"
    return "parameters and gradients"


def _peak(memory: ModelMemory) -> str:
    temporaries = " and its optimizer step's temporaries" if memory.optimizer.step_temporaries else ""
    return f"DDP's gradient buckets{temporaries}"


def _sharded_peak(memory: ModelMemory) -> str:
    temporaries = " or its optimizer step's temporaries" if memory.optimizer.step_temporaries else ""
    return f"the largest unit gathered{temporaries}"


def _on_top(memory: ModelMemory) -> str:
    if memory.optimizer.counted:
        return "activations come on top"
    return f"optimizer state {memory.optimizer.note}; activations come on top"


def fitting_reason(memory: ModelMemory) -> str:
    """Why a whole copy stays (``mgpu_ddp``), with the numbers."""
    return (
        f"a whole copy of the {_contents(memory)} takes {format_bytes(memory.whole)} per device with"
        f" {_peak(memory)}, within the {format_bytes(memory.device_memory)} of a device ({_on_top(memory)})"
    )


def sharding_reason(memory: ModelMemory) -> str:
    """Why ``mgpu_fsdp`` was chosen, with the numbers."""
    return (
        f"a whole copy of the {_contents(memory)} takes {format_bytes(memory.whole)} per device with"
        f" {_peak(memory)}, more than the {format_bytes(memory.device_memory)} of a device, but sharded they"
        f" need {format_bytes(memory.sharded)} per device with {_sharded_peak(memory)} ({_on_top(memory)})"
    )


def shortfall_reason(memory: ModelMemory) -> str:
    """Why neither ``mgpu_ddp`` nor ``mgpu_fsdp`` can hold the model, with the numbers and what would."""
    if memory.fewest_devices is None:
        fix = (
            "no number of devices helps while its largest unit, gathered whole, and the rows FSDP cannot"
            " split any further (one of each parameter per device) do not fit: shard smaller blocks"
            " (MGPUFSDPStrategy(block_classes=[...])) or use a lower precision"
        )
    else:
        fix = f"use at least {memory.fewest_devices} devices (devices=, num_nodes=) or a lower precision"
    return (
        f"the model does not fit a device of {format_bytes(memory.device_memory)} even sharded: its"
        f" {_contents(memory)} take {format_bytes(memory.whole)} whole with {_peak(memory)} and"
        f" {format_bytes(memory.sharded)} per device sharded over"
        f" {counted(memory.world, 'process', 'processes')} with {_sharded_peak(memory)} ({_on_top(memory)});"
        f" {fix}"
    )
