"""Measured steps on copies of a module's tensors: training (one warm-up, two measured) or inference (two).

The copies live on ``meta`` (nothing is computed) or CPU; the module is called through
``torch.func.functional_call`` so its own parameters, buffers and gradients stay as
they were. The order of a training step is Lightning's automatic optimization: forward (the last
step's gradients still alive), ``zero_grad(set_to_none=True)``, backward, optimizer step.
An inference pass runs in eval mode under ``torch.no_grad()``: no gradients, no optimizer state,
nothing saved for backward, only the parameters, buffers, the batch and the forward's peak.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.func import functional_call

from lightning_mgpu.estimate.batch import batch_rows, resized, tensors
from lightning_mgpu.estimate.live_bytes import LiveBytes, SavedBytes, unique_bytes
from lightning_mgpu.estimate.memory_estimate import MemoryEstimate
from lightning_mgpu.estimate.optimizer_state import (
    copy_optimizer,
    meta_like,
    module_optimizers,
    quiet_lightning,
    state_bytes,
)
from lightning_mgpu.precision import PRECISIONS

__all__ = ["measure_steps", "torch_dtypes"]


class _StepCall(nn.Module):
    """Lets ``functional_call`` run any step function, not only ``forward``."""

    def __init__(self, module: nn.Module, step: Callable[[nn.Module, Any], Any]) -> None:
        super().__init__()
        self.module = module
        self._step = step

    def forward(self, batch: Any) -> Any:
        return self._step(self.module, batch)


def _resolve_step(module: nn.Module, step_fn: Callable[[nn.Module, Any], Any] | None, inference: bool) -> Any:
    """``step_fn``, else the LightningModule's ``training_step(batch, 0)`` (``predict_step`` for
    ``inference``), else a plain ``nn.Module``'s ``module(batch)``."""
    if step_fn is not None:
        return step_fn
    hook = "predict_step" if inference else "training_step"
    if not hasattr(module, hook):
        return lambda module, batch: module(batch)
    if not inference and getattr(module, "automatic_optimization", True) is False:
        raise ValueError(
            f"{type(module).__name__} uses manual optimization, so its training_step does not return a"
            " loss: pass step_fn=lambda module, batch: <loss> to estimate_memory"
        )
    return lambda module, batch: getattr(module, hook)(batch, 0)


def _resolve_optimizers(
    module: nn.Module, optimizer: torch.optim.Optimizer | None, notes: list[str]
) -> list[torch.optim.Optimizer]:
    try:
        found = module_optimizers(module, optimizer)
    except ValueError as err:
        raise ValueError(f"{err} to estimate_memory") from err.__cause__
    if not found:
        notes.append("no optimizer: optimizer state is not counted (pass optimizer=...)")
    return found


def _loss_of(out: Any) -> torch.Tensor:
    if isinstance(out, Mapping) and "loss" in out:
        out = out["loss"]
    if not isinstance(out, torch.Tensor):
        raise ValueError(
            f"the training step returned {type(out).__name__}: return the loss tensor (or a dict with"
            " 'loss'), or pass step_fn=lambda module, batch: <loss> to estimate_memory"
        )
    if not out.requires_grad:
        raise ValueError("the training step's loss does not require grad: nothing would be trained")
    return out if out.numel() == 1 else out.sum()


def _step(
    call: Callable[[Any], Any],
    batch: Any,
    optimizers: list[torch.optim.Optimizer],
    leaves: list[torch.Tensor],
    tracker: LiveBytes,
    static: list[torch.Tensor],
    inference: bool,
) -> dict[str, int]:
    """One step's peaks and bytes; under ``inference`` (and ``torch.no_grad()``) the forward alone."""
    saved = SavedBytes(static + tensors(batch))
    with tracker.phase() as forward_backward:
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            out = call(batch)
        if not inference:
            loss = _loss_of(out)
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            for leaf in leaves:
                leaf.grad = None
            loss.backward()
            del loss
    with tracker.phase() as step:
        for opt in optimizers:
            opt.step()
    return {
        "forward_backward": forward_backward["peak"],
        "optimizer_step": 0 if inference else step["peak"],
        "saved": saved.total,
        "outputs": unique_bytes(tensors(out), min_dim=1),
        "batch": unique_bytes(tensors(batch)),
    }


def _copy(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` copied to the measuring ``device``, in ``dtype`` if floating-point."""
    if device.type == "meta" and hasattr(t, "to_local"):
        # a sharded parameter (a DTensor, under mgpu_fsdp) counts by its global shape
        return meta_like(t, dtype)
    dtype = dtype if dtype is not None and t.is_floating_point() else t.dtype
    return t.detach().to(device=device, dtype=dtype, copy=True).requires_grad_(t.requires_grad)


def _sample_sizes(sample_batch: Any) -> tuple[int, int]:
    """The two batch sizes measured: the sample's, and half of it (or 2 for a sample of one row).

    Raises:
        ValueError: if the sample holds no tensor.
    """
    b1 = batch_rows(sample_batch)
    if b1 is None:
        raise ValueError("the sample batch holds no tensor: give one batch as the DataLoader yields it")
    return b1, b1 // 2 if b1 >= 2 else 2


def _fixed_and_slope(b1: int, v1: float, b2: int, v2: float) -> tuple[float, float]:
    """``(fixed, slope)`` of the line ``fixed + slope * batch`` bytes through two measurements."""
    slope = max(0.0, (v1 - v2) / (b1 - b2))
    return v1 - slope * b1, slope


def torch_dtypes(precision: str) -> tuple[torch.dtype | None, torch.dtype | None]:
    """The dtype ``precision`` keeps floating-point parameters in, and the one it autocasts to; ``None``:
    their own dtype, no autocast."""
    dtypes = PRECISIONS[precision]
    parameters = getattr(torch, dtypes.parameters) if dtypes.parameters else None
    return parameters, getattr(torch, dtypes.autocast) if dtypes.autocast else None


def measure_steps(
    module: nn.Module,
    sample_batch: Any,
    *,
    device: torch.device,
    optimizer: torch.optim.Optimizer | None,
    step_fn: Callable[[nn.Module, Any], Any] | None,
    precision: str,
    inference: bool = False,
) -> MemoryEstimate:
    """Measure steps at the sample's batch size and at half (or double) of it (training: after a warm-up).

    The estimate is for one device, with no memory given, at the sample's batch size. With ``inference``
    the steps are forward passes (eval mode, no gradients): a LightningModule runs its
    ``predict_step(batch, 0)``, any other module ``module(batch)``; gradients and optimizer state are zero,
    and so are saved activations unless the step turns gradients on itself (a saliency map), and
    ``forward_backward`` holds the forward's peak. ``precision`` is a name of ``PRECISIONS``.
    """
    param_dtype, autocast_dtype = torch_dtypes(precision)
    notes: list[str] = []
    step = _resolve_step(module, step_fn, inference)
    b1, b2 = _sample_sizes(sample_batch)
    originals = [] if inference else _resolve_optimizers(module, optimizer, notes)
    # the module's tensors, and the sample batch, copied to the measuring device in the precision measured
    copy = functools.partial(_copy, device=device, dtype=param_dtype)
    named = dict(module.named_parameters())
    params = {name: copy(p) for name, p in named.items()}
    buffers = {name: copy(b) for name, b in module.named_buffers()}
    static = [*params.values(), *buffers.values()]
    batch1 = apply_to_collection(sample_batch, torch.Tensor, copy)
    optimizers = [copy_optimizer(o, {id(p): params[name] for name, p in named.items()}) for o in originals]
    wrapper = _StepCall(module, step)
    by_name = {f"module.{k}": v for k, v in {**params, **buffers}.items()}
    autocast: Any = contextlib.nullcontext()
    if autocast_dtype is not None:
        autocast = torch.autocast(device.type, dtype=autocast_dtype)

    def call(batch: Any) -> Any:  # the step on the copies: the module's own tensors stay as they were
        with autocast:
            return functional_call(wrapper, by_name, (batch,))

    tracker = LiveBytes(device)
    tracker.track_all(static + tensors(batch1))
    # state some optimizers create when built (Adagrad's sums), before the counter started
    tracker.track_all([t for o in optimizers for state in o.state.values() for t in tensors(state)])
    trainable = [p for p in params.values() if p.requires_grad]
    run = functools.partial(
        _step,
        call,
        optimizers=optimizers,
        leaves=trainable,
        tracker=tracker,
        static=static,
        inference=inference,
    )
    was_training = module.training
    module.train(not inference)
    no_grad = torch.no_grad() if inference else contextlib.nullcontext()
    try:
        with torch.random.fork_rng(devices=[]), quiet_lightning(), tracker, no_grad:
            # a training warm-up creates the gradients and optimizer state, as Lightning's first step does
            if not inference:
                run(batch1)
            m1 = run(batch1)
            batch2 = resized(batch1, b1, b2)
            del batch1
            m2 = run(batch2)
    finally:
        module.train(was_training)
    line = {key: _fixed_and_slope(b1, m1[key], b2, m2[key]) for key in m1}
    return MemoryEstimate(
        model=type(module).__name__,
        batch_size=b1,
        devices=1,
        device_memory=None,
        measured_on=device.type,
        precision=precision,
        optimizer=", ".join(type(o).__name__ for o in originals) or "none",
        parameter_bytes=unique_bytes(list(params.values())),
        buffer_bytes=unique_bytes(list(buffers.values())),
        gradient_bytes=unique_bytes([p.grad for p in params.values() if p.grad is not None]),
        optimizer_state_bytes=state_bytes(optimizers, device),
        batch_bytes_per_sample=line["batch"][1],
        activation_bytes_per_sample=line["saved"][1],
        output_bytes_per_sample=line["outputs"][1],
        forward_backward=line["forward_backward"],
        optimizer_step=line["optimizer_step"],
        notes=tuple(notes),
        inference=inference,
    )
