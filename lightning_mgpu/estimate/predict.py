"""Predict per-device memory of a training step before training, without a GPU.

``estimate_memory(module, sample_batch, devices=N, device_memory="12GiB")`` runs one
training step (forward, backward, optimizer step) the way Lightning does, on meta
tensors (no compute, no memory) or on CPU when the model cannot run on meta, and
counts every byte it creates:

- parameters, buffers, gradients and optimizer state (from a real optimizer step on copies);
- activations saved for backward, per sample (``torch.autograd.graph.saved_tensors_hooks``);
- the live-memory peak of forward + backward and of the optimizer step, at two batch
  sizes, so the peak is known as ``fixed + per_sample * batch`` for any batch.

From these it predicts the fullest device's peak for a single device, ``mgpu_dp``
(the first card also receives the whole batch and the gathered outputs),
``mgpu_ddp`` (each device also holds DDP's gradient buckets) and ``mgpu_fsdp`` (each
device holds 1/N of the parameters, gradients and optimizer state, padding included,
plus the largest unit of ``mgpu_fsdp``'s sharding plan while it is gathered; see
``lightning_mgpu._sharding``), the largest per-device batch that fits a given memory, and how many
devices make the model fit under ``mgpu_fsdp``. The module's own weights, gradients,
buffers and random state are left untouched.

``model_state_estimate`` is the same estimate before any batch, from the model's shapes and its counted
optimizer state: ``mgpu_auto`` weighs a model by its peaks, so the two never disagree on what fits.

With ``inference=True`` it measures two forward passes in eval mode under ``torch.no_grad()``
instead (what ``Trainer.predict`` and ``validate`` run): the parameters, buffers, the batch
and the forward's live peak, with no gradients, optimizer state or saved activations.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from lightning_mgpu._compat.lightning import convert_precision_to_unified_args
from lightning_mgpu._sharding.per_device import parameter_and_gradient_bytes, parameter_rows, unit_bytes
from lightning_mgpu._sharding.plan import BlockClasses, plan_sharding
from lightning_mgpu.devices import cuda_devices, parse_bytes
from lightning_mgpu.estimate.memory_estimate import STRATEGIES, MemoryEstimate
from lightning_mgpu.estimate.optimizer_state import OptimizerState, meta_like
from lightning_mgpu.estimate.steps import measure_steps, torch_dtypes
from lightning_mgpu.precision import PRECISIONS, precision_names

__all__ = ["STRATEGIES", "MemoryEstimate", "device_memory_of", "estimate_memory", "model_state_estimate"]

log = logging.getLogger(__name__)


def _precision_name(precision: str | int | None) -> str:
    """Lightning's name for ``precision`` (``16`` -> ``"16-mixed"``), as the Trainer resolves it."""
    if precision is None:
        return "32-true"
    try:
        name = str(convert_precision_to_unified_args(precision))  # type: ignore[arg-type]
    except ValueError:
        name = str(precision)
    if name not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}: use one of {', '.join(precision_names())}")
    return name


def estimate_memory(
    module: nn.Module,
    sample_batch: Any,
    *,
    devices: int = 1,
    device_memory: int | str | None = None,
    batch_size: int | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    precision: str | int | None = None,
    step_fn: Callable[[nn.Module, Any], Any] | None = None,
    measure_on: str = "auto",
    inference: bool = False,
    block_classes: BlockClasses | None = None,
) -> MemoryEstimate:
    """Predict per-device memory for training ``module`` on batches like ``sample_batch``.

    - runs one warm-up step and two measured steps (at the sample's batch size and at
      half or double of it) on copies of the parameters, so the module is not changed;
    - a ``LightningModule`` is stepped through its ``training_step(batch, 0)`` and
      optimized by what its ``configure_optimizers()`` returns; any other module is
      called as ``module(batch)`` and the sum of its output is the loss;
    - ``measure_on="auto"`` tries meta tensors first (nothing is computed) and falls
      back to CPU when the step cannot run on meta (e.g. it calls ``.item()``).

    Args:
        module: the model; a ``LightningModule`` or any ``nn.Module``.
        sample_batch: one batch as the DataLoader yields it; its first dimension is the batch.
        devices: devices to predict ``mgpu_dp`` / ``mgpu_ddp`` for.
        device_memory: memory of one device (``"12GiB"``, ``"80GB"`` or bytes) for the fit
            columns; ``None`` uses the smallest visible CUDA device, if any.
        batch_size: the DataLoader's batch to predict for (per device under ``mgpu_ddp``,
            split over the devices under ``mgpu_dp``); defaults to the sample's batch.
        optimizer: an optimizer over ``module``'s parameters; defaults to ``configure_optimizers()``.
        precision: Lightning's precision: ``"32-true"`` (default), ``"16-mixed"``,
            ``"bf16-mixed"``, ``"16-true"``, ``"bf16-true"`` or ``"64-true"``, or the short
            forms the Trainer also takes (``16``, ``"bf16"``, ``32``, ``64``).
        step_fn: ``step_fn(module, batch)`` returning the loss (or a dict with ``"loss"``),
            for modules with manual optimization or an unusual forward.
        measure_on: ``"auto"``, ``"meta"`` or ``"cpu"``.
        inference: predict the memory of inference (``Trainer.predict`` or ``validate``) instead:
            the module in eval mode under ``torch.no_grad()``, a ``LightningModule`` through its
            ``predict_step(batch, 0)`` (or ``step_fn``); no gradients, optimizer state or saved
            activations, so ``optimizer`` is not used.
        block_classes: the classes (or class names) ``mgpu_fsdp`` shards as units, as given to
            ``MGPUFSDPStrategy(block_classes=...)``; ``None`` for its automatic policy.

    Returns:
        A :class:`MemoryEstimate`; ``print()`` it for the report.

    Raises:
        ValueError: for an unknown precision, strategy input, memory size or a step that
            does not return a loss.

    Example::

        import torch
        from torch import nn
        from lightning_mgpu import estimate_memory

        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
        optimizer = torch.optim.Adam(model.parameters())
        batch = torch.randn(16, 32)  # one batch as the DataLoader yields it
        print(estimate_memory(model, batch, devices=2, device_memory="12GiB", optimizer=optimizer))
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected an nn.Module (or LightningModule), got {type(module).__name__}")
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be a positive integer, got {devices!r}")
    if measure_on not in ("auto", "meta", "cpu"):
        raise ValueError(f"measure_on must be 'auto', 'meta' or 'cpu', got {measure_on!r}")
    precision_name = _precision_name(precision)
    memory = device_memory_of(device_memory, "cuda")
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    param_dtype, autocast_dtype = torch_dtypes(precision_name)

    notes: list[str] = []
    places = ["meta", "cpu"] if measure_on == "auto" else [measure_on]
    if autocast_dtype is not None and "meta" in places:
        if measure_on == "meta":
            raise ValueError(
                f"precision {precision_name!r} needs autocast, which meta tensors ignore:"
                " use measure_on='cpu'"
            )
        places = ["cpu"]
        log.debug("precision %s needs autocast, which meta tensors ignore: measuring on cpu", precision_name)
    for place in places:
        try:
            measured = measure_steps(
                module,
                sample_batch,
                device=torch.device(place),
                optimizer=optimizer,
                step_fn=step_fn,
                precision=precision_name,
                inference=inference,
            )
            break
        except (RuntimeError, NotImplementedError, TypeError, AttributeError) as err:
            if place == places[-1]:
                raise
            log.debug(
                "measuring on %s failed (%s: %s); trying %s", place, type(err).__name__, err, places[-1]
            )
            notes.append(f"could not step on meta tensors ({type(err).__name__}: {err}); measured on CPU")
    rows, units = _sharding(module, param_dtype, precision_name, block_classes)
    return replace(
        measured,
        batch_size=batch_size or measured.batch_size,
        devices=devices,
        device_memory=memory,
        notes=(*notes, *measured.notes),
        parameter_rows=rows,
        unit_bytes=units,
    )


def model_state_estimate(
    module: nn.Module,
    state: OptimizerState,
    *,
    devices: int,
    device_memory: int | None,
    precision: str = "32-true",
    block_classes: BlockClasses | None = None,
) -> MemoryEstimate:
    """The estimate of what the model alone needs, before any batch: ``mgpu_auto``'s numbers.

    - parameters, buffers and gradients counted by their shapes, in the dtype ``precision`` keeps them in;
    - ``state``: what ``count_optimizer_state`` counted, with its step's temporaries;
    - forward and backward hold all of them (the last step's gradients live until backward), the
      optimizer step holds them and its temporaries; nothing scales with a batch (activations come on
      top), so ``peak(strategy, per_device_batch=0)`` is each strategy's peak by the arithmetic
      ``estimate_memory``'s own report uses.

    Args:
        module: The model (meta tensors count by their shape; a sharded one by its global shape).
        state: Its optimizer state, from ``count_optimizer_state`` in the same precision.
        devices: Processes ``mgpu_fsdp`` shards over.
        device_memory: Memory of one device, for ``devices_to_fit``.
        precision: The Trainer's precision (unknown names keep the parameters' own dtype).
        block_classes: As for ``estimate_memory``.
    """
    name = precision if precision in PRECISIONS else "32-true"
    param_dtype, _ = torch_dtypes(name)

    rows, units = _sharding(module, param_dtype, name, block_classes)
    parameters, gradients = parameter_and_gradient_bytes(module, rows)
    buffers = sum(meta_like(b, param_dtype).nbytes for b in module.buffers())
    held = parameters + buffers + gradients + state.bytes
    return MemoryEstimate(
        model=type(module).__name__,
        batch_size=1,
        devices=devices,
        device_memory=device_memory,
        measured_on="meta",
        precision=name,
        optimizer=state.optimizer or "none",
        parameter_bytes=parameters,
        buffer_bytes=buffers,
        gradient_bytes=gradients,
        optimizer_state_bytes=state.bytes,
        batch_bytes_per_sample=0.0,
        activation_bytes_per_sample=0.0,
        output_bytes_per_sample=0.0,
        forward_backward=(float(held), 0.0),
        optimizer_step=(float(held + state.step_temporaries), 0.0),
        notes=(state.note,) if state.note else (),
        parameter_rows=rows,
        unit_bytes=units,
    )


def _sharding(
    module: nn.Module, param_dtype: torch.dtype | None, precision: str, block_classes: BlockClasses | None
) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
    """What ``mgpu_fsdp`` would split: each parameter's rows, and each unit's gathered bytes."""
    if next(module.parameters(), None) is None:
        return (), ()  # nothing to shard; plan_sharding would refuse the model
    plan = plan_sharding(module, block_classes)
    # mgpu_fsdp gathers in bfloat16 under bf16-mixed (its MixedPrecisionPolicy); "-true" converts the model
    gather = torch.bfloat16 if precision == "bf16-mixed" else param_dtype
    itemsize = gather.itemsize if gather is not None else None
    return parameter_rows(module, param_dtype), tuple(unit_bytes(module, plan, itemsize))


def device_memory_of(device_memory: int | str | None, device_type: str) -> int | None:
    """``device_memory`` in bytes; without it the smallest CUDA device's on CUDA, else ``None``."""
    if device_memory is not None:
        return parse_bytes(device_memory)
    totals = [d.total_bytes for d in cuda_devices() if d.total_bytes] if device_type == "cuda" else []
    return min(totals) if totals else None
