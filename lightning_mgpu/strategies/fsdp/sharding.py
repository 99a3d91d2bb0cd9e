"""Applying a sharding plan with FSDP2: the options, the Trainer precision's dtypes, and ``fully_shard``.

- ``ShardingOptions``: ``reshard_after_forward``, mixed precision, CPU offload and activation
  checkpointing, checked when the strategy is created, and against the devices, the process count
  and the precision inside ``Trainer(...)`` (``check_for_run``);
- ``mixed_precision_policy``: the ``MixedPrecisionPolicy`` for a Lightning precision string;
- ``is_sharded``: whether a ``configure_model`` already called ``fully_shard``;
- ``broadcast_from_rank0``: every rank starts from rank 0's weights, as under DDP;
- ``apply_plan``: activation checkpointing of the blocks, ``fully_shard`` of each block, then the root;
- ``describe``: the plan and the options applied, as the start-up summary shows them.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from lightning_mgpu._compat.torch import FSDP_ON_CPU, activation_checkpoint, require
from lightning_mgpu._sharding.plan import ShardingPlan
from lightning_mgpu.precision import FSDP_PRECISIONS

__all__ = [
    "ShardingOptions",
    "apply_plan",
    "broadcast_from_rank0",
    "check_for_run",
    "describe",
    "is_sharded",
    "mixed_precision_policy",
    "validate_reshard",
]

log = logging.getLogger(__name__)


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy | None:
    """FSDP2's dtypes for a Trainer ``precision``.

    - ``"bf16-mixed"``: the gathered parameters (and so the forward and backward) in
      bfloat16, gradients reduced in float32, the sharded parameters and the optimizer step
      in float32;
    - ``"bf16-true"`` / ``"16-true"`` / ``"32-true"``: ``None``; the whole model is in that
      dtype already (Lightning converts it), so nothing is cast.
    """
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def validate_reshard(value: object) -> bool | int:
    """``reshard_after_forward`` as FSDP2 takes it: a bool, or a process count above 1.

    Raises:
        TypeError: If it is neither a bool nor an int.
        ValueError: If it is an int below 2.
    """
    if isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise TypeError(
            "reshard_after_forward must be True (free the gathered parameters after each block's forward:"
            " least memory), False (keep them for the backward: less communication) or an int, the number"
            f" of processes to reshard over, got {value!r} of type {type(value).__name__}"
        )
    if value < 2:
        raise ValueError(
            f"reshard_after_forward={value}: as an int it is the number of processes to reshard over after"
            " the forward and must be at least 2 (use True or False otherwise)"
        )
    return value


@dataclass(frozen=True)
class ShardingOptions:
    """How the plan's units are sharded.

    Attributes:
        reshard_after_forward: FSDP2's argument of that name for the blocks.
        cpu_offload: Keep the parameter shards, their gradients and the optimizer state in CPU memory.
        activation_checkpointing: Recompute each block's activations in the backward instead of keeping them.
    """

    reshard_after_forward: bool | int = True
    cpu_offload: bool = False
    activation_checkpointing: bool = False

    def changed(self) -> list[str]:
        """The names of the options set to other than their defaults."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not f.default]

    def __post_init__(self) -> None:
        validate_reshard(self.reshard_after_forward)
        for name in ("cpu_offload", "activation_checkpointing"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")


def check_for_run(options: ShardingOptions, devices: list[torch.device], world: int, precision: str) -> None:
    """Refuse, inside ``Trainer(...)``, ``options`` this run cannot use: on CPUs, over ``world`` processes,
    in ``precision``.

    Raises:
        RuntimeError: CPU devices on a torch where FSDP2 cannot run on CPU.
        ValueError: ``cpu_offload`` on CPU devices, a ``reshard_after_forward`` count that does not
            divide the processes, or a precision FSDP2 cannot run.
    """
    on_cpu = bool(devices) and all(d.type == "cpu" for d in devices)
    if on_cpu:
        require(FSDP_ON_CPU)
    if options.cpu_offload and on_cpu:
        raise ValueError(
            "mgpu_fsdp: cpu_offload=True keeps the model state in CPU memory while GPUs compute, but this"
            " run computes on CPU: its model state is in CPU memory already. Remove cpu_offload=True, or"
            " train on GPUs (accelerator='gpu')."
        )
    reshard = options.reshard_after_forward
    if not isinstance(reshard, bool) and (reshard >= world or world % reshard):
        raise ValueError(
            f"mgpu_fsdp: reshard_after_forward={reshard} must divide the {world} processes and be smaller"
            f" than {world}; use True, False, or one of"
            f" {[n for n in range(2, world) if world % n == 0] or 'none at this size'}"
        )
    if precision not in FSDP_PRECISIONS:
        raise ValueError(
            f"mgpu_fsdp does not support precision={precision!r}: choose one of {', '.join(FSDP_PRECISIONS)}"
        )


def is_sharded(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was already applied to ``module`` or any of its submodules."""
    return any(isinstance(m, FSDPModule) for m in module.modules())


def broadcast_from_rank0(module: nn.Module, device: torch.device) -> None:
    """Copy rank 0's parameters and buffers into every rank's ``module``, one tensor at a time.

    ``fully_shard`` cuts each rank's shard from that rank's own copy, so ranks that
    initialised the model differently would train a patchwork of their inits; DDP avoids it
    by broadcasting rank 0's weights, and so does this. Each tensor goes through ``device``
    (NCCL cannot send CPU tensors), so the extra memory there is the largest tensor.
    Tensors on the meta device (``empty_init=True``) are skipped: they are materialised later.
    """
    tensors = [t for t in (*module.parameters(), *module.buffers()) if not t.is_meta]
    with torch.no_grad():
        for t in tensors:
            here = t.device == device
            moved = t.detach() if here else t.detach().to(device)
            dist.broadcast(moved, src=0)
            if not here:
                t.copy_(moved)
    log.debug("broadcast %d tensors of rank 0's model to every rank before sharding", len(tensors))


def apply_plan(
    module: nn.Module,
    plan: ShardingPlan,
    mesh: DeviceMesh,
    options: ShardingOptions,
    mp_policy: MixedPrecisionPolicy | None,
    pin_memory: bool = False,
) -> None:
    """Shard ``module`` in place: each block of ``plan``, then the root.

    Activation checkpointing uses torch's composable ``checkpoint``, which keeps the
    parameter names (and so the checkpoints' keys) unchanged.
    """
    kwargs: dict = {"mesh": mesh, "reshard_after_forward": options.reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if options.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=pin_memory)
    blocks = [module.get_submodule(name) for name in plan.blocks]
    if options.activation_checkpointing:
        for block in blocks:
            activation_checkpoint(block)
    for name, block in zip(plan.blocks, blocks, strict=True):
        log.debug("fully_shard(%s) (%s)", name, type(block).__name__)
        fully_shard(block, **kwargs)
    if mp_policy is not None:
        # the root's inputs are the user's batch (targets included): leave their dtypes alone
        kwargs["mp_policy"] = dataclasses.replace(mp_policy, cast_forward_inputs=False)
    fully_shard(module, **kwargs)
    log.debug("fully_shard(root) with %s", {k: v for k, v in kwargs.items() if k != "mesh"})


def describe(plan: ShardingPlan, options: ShardingOptions, precision: str) -> str:
    """``plan`` and ``options`` in words, with the dtypes ``precision`` gathers and reduces in."""
    applied = [f"reshard_after_forward={options.reshard_after_forward}"]
    applied += [name for name in ("cpu_offload", "activation_checkpointing") if getattr(options, name)]
    policy = mixed_precision_policy(precision)
    if policy is not None:
        applied.append(
            f"parameters gathered in {policy.param_dtype}, gradients reduced in {policy.reduce_dtype}"
        )
    return f"{plan.describe()}, blocks chosen by the {plan.chosen_by}; {', '.join(applied)}"
