"""The least a device needs under ``mgpu_fsdp``, optimizer included, and the refusal when it does not fit.

``sharded_model_need`` counts the fullest device's shards of the parameters, gradients and optimizer
state, and the largest unit gathered (``lightning_mgpu._sharding.per_device``), in the dtypes the Trainer's
precision gives them. The optimizer state is what one step of the model's ``configure_optimizers()``
creates, counted on meta tensors (``lightning_mgpu.estimate.optimizer_state``) with the Trainer hidden,
so counting loads no data; an optimizer that cannot be counted so is left out, and the result says why.
``check_fits`` refuses, before sharding, a need above a device's memory: with the numbers and the fix;
``check_model_fits`` counts a model's need and checks it against a CUDA device's memory.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from lightning_mgpu._compat.lightning import attached_trainer, detach_trainer
from lightning_mgpu._sharding.per_device import ShardedNeed, sharded_need
from lightning_mgpu._sharding.plan import ShardingPlan, plan_sharding
from lightning_mgpu.devices import format_bytes
from lightning_mgpu.estimate.optimizer_state import OptimizerState, count_optimizer_state
from lightning_mgpu.precision import PRECISIONS
from lightning_mgpu.strategies.fsdp.sharding import mixed_precision_policy

__all__ = ["check_fits", "check_model_fits", "count_state", "sharded_model_need", "without_trainer"]

log = logging.getLogger(__name__)

_ON_TOP = {False: "optimizer state and activations come on top", True: "activations come on top"}


@contextlib.contextmanager
def without_trainer(model: Any) -> Iterator[None]:
    """Hide the Trainer from ``configure_optimizers`` while it is counted, before the Trainer set up anything.

    A ``configure_optimizers`` that reads ``self.trainer`` (``estimated_stepping_batches``, say) would
    make the Trainer load the data now, before the strategy's own set-up; it fails instead, and the
    optimizer state is not counted (the reason says so).
    """
    trainer = attached_trainer(model)
    if trainer is None:
        yield
        return
    detach_trainer(model, None)
    try:
        yield
    finally:
        detach_trainer(model, trainer)


def count_state(
    model: Any, precision: str, optimizer: torch.optim.Optimizer | None = None
) -> tuple[OptimizerState, torch.dtype | None]:
    """The optimizer state of ``model`` (``optimizer``, else its ``configure_optimizers()``) under the
    Trainer's ``precision``, and the dtype that precision converts the parameters to (``None``: their own)."""
    converted = PRECISIONS[precision].parameters if precision in PRECISIONS else None
    param_dtype = getattr(torch, converted) if converted else None
    with without_trainer(model):
        return count_optimizer_state(model, optimizer=optimizer, param_dtype=param_dtype), param_dtype


def sharded_model_need(
    model: Any,
    world: int,
    precision: str = "32-true",
    *,
    plan: ShardingPlan | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    offloaded: bool = False,
) -> tuple[ShardedNeed, OptimizerState]:
    """The least memory a device needs for ``model`` and its optimizer sharded over ``world`` ranks.

    Args:
        model: The model (meta tensors count by their shape).
        world: Number of processes.
        precision: The Trainer's precision: ``bf16-true`` / ``16-true`` count the floating-point
            parameters, gradients and optimizer state at 2 bytes (``64-true`` at 8), ``bf16-mixed``
            gathers the units at 2 bytes.
        plan: The sharding plan; ``None`` plans it as ``mgpu_fsdp`` does by default.
        optimizer: The optimizer over ``model``'s parameters; ``None`` uses ``model.configure_optimizers()``.
        offloaded: The shards are kept in CPU memory (``cpu_offload=True``).
    """
    state, param_dtype = count_state(model, precision, optimizer)
    # FSDP gathers in bf16-mixed's dtype, else in the one the parameters are kept in
    policy = mixed_precision_policy(precision)
    itemsize = param_dtype.itemsize if param_dtype is not None else None
    gather = policy.param_dtype.itemsize if policy is not None and policy.param_dtype else itemsize
    need = sharded_need(
        model,
        plan if plan is not None else plan_sharding(model),
        world,
        gather,
        offloaded,
        param_dtype=param_dtype,
        optimizer_state=state.bytes,
    )
    return need, state


def check_fits(need: ShardedNeed, device_memory: int, device: str, strategy_name: str = "mgpu_fsdp") -> None:
    """Raise when ``need`` cannot fit ``device_memory``, with the estimate and what would fit.

    Raises:
        ValueError: If the lower bound exceeds the device's memory.
    """
    if need.per_device <= device_memory:
        return
    parts = f"plus {format_bytes(need.largest_unit)} for the largest unit gathered"
    if need.offloaded:
        parts = f"the shards are in CPU memory; {parts}"
    else:
        what = (
            "parameters, gradients and optimizer state"
            if need.optimizer_state
            else "parameters and gradients"
        )
        parts = f"{what} {format_bytes(need.state)}, 1/{need.world} each, {parts}"
    fewest = need.devices_needed(device_memory)
    if fewest is None:
        fix = (
            "no number of devices helps while one unit does not fit: shard smaller blocks"
            " (block_classes=[...]) or use a lower precision"
        )
    else:
        fix = f"use at least {fewest} devices (devices=, num_nodes=), cpu_offload=True or a lower precision"
    raise ValueError(
        f"{strategy_name}: the model needs at least {format_bytes(need.per_device)} per device on"
        f" {need.world} process(es) ({parts}; {_ON_TOP[bool(need.optimizer_state)]}), but {device} has"
        f" {format_bytes(device_memory)}. {fix[0].upper()}{fix[1:]}."
    )


def check_model_fits(
    module: Any, plan: ShardingPlan, precision: str, world: int, device: torch.device, offloaded: bool
) -> None:
    """Refuse, before anything moves to the CUDA ``device``, a model whose shards and optimizer overflow it.

    Raises:
        ValueError: as ``check_fits``.
    """
    need, state = sharded_model_need(module, world, precision, plan=plan, offloaded=offloaded)
    if not state.counted:
        log.debug("mgpu_fsdp: optimizer state not counted in the fit check: %s", state.note)
    total = torch.cuda.mem_get_info(device)[1]
    log.debug("mgpu_fsdp: at least %d bytes per device, %s has %d", need.per_device, device, total)
    check_fits(need, total, f"{device} ({torch.cuda.get_device_name(device)})")
