"""An optimizer step that runs out of memory, told with this rank's numbers and the options they give.

The first step of an optimizer such as AdamW allocates its state (two moments of every parameter
under AdamW); when that does not fit, the run ends there. ``ProcessGroupServices.optimizer_step`` wraps
the step: an out-of-memory raised after the closure (forward and backward) has returned is the step's
own, and its message gets, in front of the allocator's:

- one line (what every rank prints, through the watchdog) with the optimizer state this rank's
  step creates (``estimate.optimizer_state``: its shards under ``mgpu_fsdp``), the parameters and
  gradients it holds (``estimate.model_state``) and the device's memory where it is known;
- the options computed from these numbers: ``mgpu_fsdp`` (or more devices), a precision that keeps
  the state in 2 bytes, an optimizer with less state, and, where the numbers fit the device, what
  else holds its memory.

``StepMemory`` is the plain data; ``step_memory`` reads it from a run, ``step_oom_message`` words it.
The error keeps its type, so it is still an out-of-memory to every ``except`` and to
``DeviceMemoryMonitor``; the watchdog tells the other ranks its first line (``services.on_exception``),
and stops those waiting in a collective within seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lightning_mgpu.devices import format_bytes
from lightning_mgpu.estimate.model_state import measure_model_state
from lightning_mgpu.estimate.optimizer_state import count_optimizer_state

__all__ = ["StepMemory", "step_memory", "step_oom_message"]

_HALF_PRECISIONS = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class StepMemory:
    """What an optimizer step needs on one rank, in bytes, read from the run when it ran out.

    Attributes:
        rank: The rank whose step failed.
        strategy: ``"mgpu_ddp"`` or ``"mgpu_fsdp"``.
        world: Number of processes.
        optimizer: The optimizer's class name.
        parameters: Parameters this rank holds (its shards under ``mgpu_fsdp``).
        gradients: Gradients this rank holds.
        state: Optimizer state this rank's step creates, once all of it exists.
        held: Optimizer state that existed when the step failed.
        device: The rank's device (``"cuda:0"``).
        device_memory: Its total memory; ``None`` where it is not known (CPU).
        half: Whether the floating-point parameters are 2-byte already.
    """

    rank: int
    strategy: str
    world: int
    optimizer: str
    parameters: int
    gradients: int
    state: int
    held: int
    device: str
    device_memory: int | None = None
    half: bool = False

    @property
    def sharded(self) -> bool:
        return self.strategy == "mgpu_fsdp"

    @property
    def total(self) -> int:
        """Parameters, gradients and optimizer state on this rank, and DDP's gradient buckets."""
        buckets = 0 if self.sharded else self.gradients
        return self.parameters + self.gradients + buckets + self.state


def step_memory(
    strategy_name: str,
    rank: int,
    world: int,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
) -> StepMemory:
    """``StepMemory`` of ``optimizer``'s step on this rank; counted on meta tensors, nothing is allocated."""
    held = measure_model_state(module, [optimizer]).local
    state = count_optimizer_state(module, optimizers=[optimizer], local=True)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    half = bool(params) and all(p.dtype in _HALF_PRECISIONS for p in params if p.is_floating_point())
    memory = torch.cuda.mem_get_info(device)[1] if device.type == "cuda" else None
    return StepMemory(
        rank=rank,
        strategy=strategy_name,
        world=world,
        optimizer=type(optimizer).__name__,
        parameters=held.parameters,
        gradients=held.gradients,
        state=state.bytes,
        held=held.optimizer,
        device=str(device),
        device_memory=memory,
        half=half,
    )


def _options(memory: StepMemory) -> list[str]:
    b = format_bytes
    options = []
    if not memory.sharded:
        world = max(memory.world, 2)
        shards = (memory.parameters + memory.gradients + memory.state) // world
        options.append(
            f"strategy='mgpu_fsdp' (or mgpu_auto, which picks it from the numbers): over {world} processes"
            f" each holds about {b(shards)} of parameters, gradients and optimizer state instead of"
            f" {b(memory.total)} with DDP's gradient buckets"
        )
    else:
        more = 2 * memory.world
        options.append(
            f"more devices: over {more} processes each holds about {b(memory.total * memory.world // more)}"
            f" instead of {b(memory.total)}"
        )
        if memory.device.startswith("cuda"):
            options.append(
                "MGPUFSDPStrategy(cpu_offload=True): the shards and the optimizer state live in CPU memory"
            )
    if not memory.half:
        options.append(
            f"precision='bf16-true': parameters, gradients and optimizer state in 2 bytes, about"
            f" {b(memory.total // 2)} here ('bf16-mixed' keeps them in float32)"
        )
    if memory.state > memory.parameters:
        options.append(
            f"an optimizer with less state: {memory.optimizer} keeps {b(memory.state)} here; SGD with"
            f" momentum keeps one copy of the parameters ({b(memory.parameters)}), plain SGD none"
        )
    if memory.device_memory is not None and memory.total <= memory.device_memory:
        options.append(
            f"by the count they fit the {b(memory.device_memory)} of {memory.device}: the rest is held by"
            " tensors kept past the backward, other processes on the device (nvidia-smi) or fragmentation"
            " (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)"
        )
    return options


def step_oom_message(memory: StepMemory) -> str:
    """The lines put in front of the allocator's message: the numbers first, then the options."""
    b = format_bytes
    first = " allocating its state in its first step" if memory.held < memory.state else ""
    whose = " for this rank's shards" if memory.sharded else ""
    on = f" on a device of {b(memory.device_memory)}" if memory.device_memory is not None else ""
    line = (
        f"[rank {memory.rank}] out of memory in the optimizer step ({memory.optimizer}{first}:"
        f" {b(memory.state)} of optimizer state{whose}, beside {b(memory.parameters)} of parameters and"
        f" {b(memory.gradients)} of gradients on this rank, {memory.strategy} over {memory.world}"
        f" process(es){on})"
    )
    return "\n".join([line, "What would fit:", *(f"- {option};" for option in _options(memory))])
