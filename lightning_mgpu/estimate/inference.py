"""Two measured inference passes (eval mode, no gradients) on copies of a module's tensors.

The copies and the batch sizes are made as for the training steps (``measuring.py``);
here nothing is trained: no gradients, no optimizer state, nothing saved for backward,
only the parameters, buffers, the batch and what the forward holds at its peak.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_mgpu.estimate.batch import resized, tensors
from lightning_mgpu.estimate.live_bytes import LiveBytes
from lightning_mgpu.estimate.measuring import (
    Line,
    MeasuredStep,
    forward_step,
    make_copies,
    quiet_lightning,
    sample_sizes,
    unique_bytes,
)

__all__ = ["measure_inference"]


def _predict_step(module: nn.Module, batch: Any) -> Any:
    return module.predict_step(batch, 0)  # type: ignore[operator]


def _inference(call: Callable[[Any], Any], batch: Any, tracker: LiveBytes) -> dict[str, int]:
    with tracker.phase() as forward:
        out = call(batch)
    return {
        "forward": forward["peak"],
        "outputs": unique_bytes(tensors(out), min_dim=1),
        "batch": unique_bytes(tensors(batch)),
    }


def measure_inference(
    module: nn.Module,
    sample_batch: Any,
    *,
    device: torch.device,
    step_fn: Callable[[nn.Module, Any], Any] | None,
    param_dtype: torch.dtype | None,
    autocast_dtype: torch.dtype | None,
) -> MeasuredStep:
    """Measure inference (eval mode, no gradients) at the sample's batch size and at half (or double) of it.

    A LightningModule runs its ``predict_step(batch, 0)``, any other module ``module(batch)``.
    Gradients, optimizer state and saved activations are zero; ``forward_backward`` holds the
    forward's peak, ``optimizer_step`` nothing.
    """
    step = step_fn or (_predict_step if hasattr(module, "predict_step") else forward_step)
    b1, b2 = sample_sizes(sample_batch)
    copies, batch1 = make_copies(module, sample_batch, step, device, param_dtype, autocast_dtype)
    tracker = LiveBytes(device)
    tracker.track_all(copies.static + tensors(batch1))
    was_training = module.training
    module.eval()
    try:
        with torch.random.fork_rng(devices=[]), quiet_lightning(), tracker, torch.no_grad():
            m1 = _inference(copies.call, batch1, tracker)
            batch2 = resized(batch1, b1, b2)
            del batch1
            m2 = _inference(copies.call, batch2, tracker)
    finally:
        module.train(was_training)
    nothing = Line(0.0, 0.0)
    return MeasuredStep(
        device=device.type,
        optimizer="none",
        sample_batch_size=b1,
        parameter_bytes=unique_bytes(list(copies.params.values())),
        buffer_bytes=unique_bytes(list(copies.buffers.values())),
        gradient_bytes=0,
        optimizer_state_bytes=0,
        **{key: Line.through(b1, m1[key], b2, m2[key]) for key in ("batch", "outputs")},
        saved=nothing,
        forward_backward=Line.through(b1, m1["forward"], b2, m2["forward"]),
        optimizer_step=nothing,
        notes=(),
    )
