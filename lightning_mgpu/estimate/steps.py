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
from torch import nn

from lightning_mgpu.estimate.batch import resized, tensors
from lightning_mgpu.estimate.live_bytes import LiveBytes, SavedBytes
from lightning_mgpu.estimate.measuring import (
    fixed_and_slope,
    forward_step,
    make_copies,
    quiet_lightning,
    sample_sizes,
    unique_bytes,
)
from lightning_mgpu.estimate.memory_estimate import MemoryEstimate
from lightning_mgpu.estimate.optimizer_state import copy_optimizer, module_optimizers, state_bytes

__all__ = ["measure_steps"]


def _lightning_step(hook: str, module: nn.Module, batch: Any) -> Any:
    return getattr(module, hook)(batch, 0)


def _resolve_step(module: nn.Module, step_fn: Callable[[nn.Module, Any], Any] | None, inference: bool) -> Any:
    if step_fn is not None:
        return step_fn
    hook = "predict_step" if inference else "training_step"
    if not hasattr(module, hook):
        return forward_step
    if not inference and getattr(module, "automatic_optimization", True) is False:
        raise ValueError(
            f"{type(module).__name__} uses manual optimization, so its training_step does not return a"
            " loss: pass step_fn=lambda module, batch: <loss> to estimate_memory"
        )
    return functools.partial(_lightning_step, hook)


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


def measure_steps(
    module: nn.Module,
    sample_batch: Any,
    *,
    device: torch.device,
    optimizer: torch.optim.Optimizer | None,
    step_fn: Callable[[nn.Module, Any], Any] | None,
    precision: str,
    param_dtype: torch.dtype | None,
    autocast_dtype: torch.dtype | None,
    inference: bool = False,
) -> MemoryEstimate:
    """Measure steps at the sample's batch size and at half (or double) of it (training: after a warm-up).

    The estimate is for one device, with no memory given, at the sample's batch size. With ``inference``
    the steps are forward passes (eval mode, no gradients): a LightningModule runs its
    ``predict_step(batch, 0)``, any other module ``module(batch)``; gradients, optimizer state and saved
    activations are zero, ``forward_backward`` holds the forward's peak.
    """
    notes: list[str] = []
    step = _resolve_step(module, step_fn, inference)
    b1, b2 = sample_sizes(sample_batch)
    originals = [] if inference else _resolve_optimizers(module, optimizer, notes)
    copies, batch1 = make_copies(module, sample_batch, step, device, param_dtype, autocast_dtype)
    params, static, call = copies.params, copies.static, copies.call
    optimizers = [copy_optimizer(o, copies.leaf_of) for o in originals]
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
    line = {key: fixed_and_slope(b1, m1[key], b2, m2[key]) for key in m1}
    return MemoryEstimate(
        model=type(module).__name__,
        batch_size=b1,
        devices=1,
        device_memory=None,
        measured_on=device.type,
        precision=precision,
        optimizer=", ".join(type(o).__name__ for o in originals) or "none",
        parameter_bytes=unique_bytes(list(params.values())),
        buffer_bytes=unique_bytes(list(copies.buffers.values())),
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
