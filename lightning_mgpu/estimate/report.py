"""The estimate as people read it: one table of each strategy's peak, for the library and the command line.

- ``strategy_rows`` turns a ``MemoryEstimate`` into one ``StrategyRow`` per strategy: the batch
  on each device, the global batch, the fullest device's peak, whether it fits, the largest batch;
- ``format_estimate`` prints them under what was measured, with the notes that explain the rows
  and, when not even one sample per device fits, what would.

The batch the estimate was made for is read one of two ways: a DataLoader's batch (``str(est)``:
each ``mgpu_ddp`` process loads it, ``mgpu_dp`` splits it) or a config's global batch
(``lightning-mgpu estimate``: every strategy splits it over the devices).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Protocol

from lightning_mgpu._words import aligned
from lightning_mgpu.devices import format_bytes

__all__ = ["StrategyRow", "format_estimate", "strategy_rows"]

log = logging.getLogger(__name__)


class MemoryEstimate(Protocol):
    """What the report reads of ``memory_estimate.MemoryEstimate`` (frozen: read-only here too), whose
    ``str()`` is this report: the imports then run one way, from the estimate to its report."""

    @property
    def model(self) -> str: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def devices(self) -> int: ...
    @property
    def device_memory(self) -> int | None: ...
    @property
    def measured_on(self) -> str: ...
    @property
    def precision(self) -> str: ...
    @property
    def optimizer(self) -> str: ...
    @property
    def parameter_bytes(self) -> int: ...
    @property
    def buffer_bytes(self) -> int: ...
    @property
    def gradient_bytes(self) -> int: ...
    @property
    def optimizer_state_bytes(self) -> int: ...
    @property
    def batch_bytes_per_sample(self) -> float: ...
    @property
    def activation_bytes_per_sample(self) -> float: ...
    @property
    def output_bytes_per_sample(self) -> float: ...
    @property
    def forward_backward(self) -> tuple[float, float]: ...
    @property
    def notes(self) -> tuple[str, ...]: ...
    @property
    def inference(self) -> bool: ...
    @property
    def unit_bytes(self) -> tuple[int, ...]: ...

    @property
    def model_state_bytes(self) -> int: ...
    @property
    def largest_unit_bytes(self) -> int: ...
    def sharded_state_bytes(self, devices: int | None = None) -> int: ...
    def peak(
        self, strategy: str = ..., per_device_batch: int | None = None, devices: int | None = None
    ) -> int: ...
    def devices_to_fit(
        self, device_memory: int | str | None = None, per_device_batch: int | None = None
    ) -> int | None: ...
    def other_device_peak(self, per_device_batch: int | None = None) -> int: ...
    def largest_per_device_batch(
        self, strategy: str = ..., device_memory: int | str | None = None
    ) -> int: ...


@dataclass(frozen=True)
class StrategyRow:
    """One strategy's line of the estimate."""

    strategy: str
    per_device_batch: int
    global_batch: int
    devices: int
    """Devices the strategy spreads the global batch over."""
    peak: int
    """Predicted peak bytes on the fullest device (card 0 under ``mgpu_dp``)."""
    fits: bool | None
    """Whether ``peak`` fits one device's memory; ``None`` when no memory was given."""
    largest_per_device: int | None
    """The largest batch per device that fits (0: not even one sample); ``None`` without memory."""

    @property
    def largest_global(self) -> int | None:
        return None if self.largest_per_device is None else self.largest_per_device * self.devices


def strategy_rows(est: MemoryEstimate, *, global_batch: bool = False) -> list[StrategyRow]:
    """Each strategy's row; ``global_batch`` reads ``est.batch_size`` as split over the devices by all.

    With one device only the ``single`` row is given: the others would run the same step.
    """
    n = est.devices
    split = math.ceil(est.batch_size / n)  # mgpu_dp's largest chunk
    # each mgpu_ddp / mgpu_fsdp process loads the DataLoader's whole batch, or its share of a global one
    per_process = est.batch_size // n if global_batch else est.batch_size
    shapes = [("single", est.batch_size, 1), ("mgpu_dp", split, n), ("mgpu_ddp", per_process, n)]
    if est.unit_bytes:  # a model with parameters: mgpu_fsdp has something to shard
        shapes.append(("mgpu_fsdp", per_process, n))
    rows = []
    for strategy, per_device, devices in shapes[: 1 if n == 1 else None]:
        peak = est.peak(strategy, per_device_batch=per_device)
        memory = est.device_memory
        rows.append(
            StrategyRow(
                strategy=strategy,
                per_device_batch=per_device,
                global_batch=est.batch_size if strategy == "mgpu_dp" else per_device * devices,
                devices=devices,
                peak=peak,
                fits=None if memory is None else peak <= memory,
                largest_per_device=None if memory is None else est.largest_per_device_batch(strategy),
            )
        )
    return rows


def format_estimate(est: MemoryEstimate, *, heading: str | None = None, global_batch: bool = False) -> str:
    """The report: what was measured, one row per strategy, and notes.

    Args:
        est: the estimate.
        heading: the first line; defaults to one naming the model, precision and optimizer.
        global_batch: read ``est.batch_size`` as a global batch split over the devices by every
            strategy (a config's ``data.batch_size``) rather than as a DataLoader's batch.
    """
    memory = f", {format_bytes(est.device_memory)} per device" if est.device_memory else ""
    if heading is None:
        kind, what = "Memory", f"optimizer {est.optimizer}"
        if est.inference:
            kind, what = "Inference memory", "no gradients or optimizer state"
        heading = f"{kind} estimate for {est.model} ({est.precision}, {what}, measured on {est.measured_on})"
    held = {"parameters": est.parameter_bytes, "buffers": est.buffer_bytes}
    if not est.inference:
        held.update({"gradients": est.gradient_bytes, "optimizer state": est.optimizer_state_bytes})
    lines = [heading, *(f"  {name:<21}{format_bytes(size):>12}" for name, size in held.items())]
    batch = f"global batch {est.batch_size}" if global_batch else f"DataLoader batch {est.batch_size}"
    lines += [
        f"  per sample: {_per_sample(est)}",
        "",
        f"Predicted peak per device, {batch}, {est.devices} device(s){memory}:",
    ]
    rows = strategy_rows(est, global_batch=global_batch)
    cells = [["strategy", "batch/device", "global batch", "peak/device"]]
    cells += [[r.strategy, str(r.per_device_batch), str(r.global_batch), format_bytes(r.peak)] for r in rows]
    if memory:
        cells[0] += ["fits", "largest batch/device", "largest global batch"]
        for cell, r in zip(cells[1:], rows, strict=True):
            cell += ["yes" if r.fits else "NO", _largest(r.largest_per_device), _largest(r.largest_global)]
    lines += ["  " + line for line in aligned(cells, right_from=1, widths=(10, 12, 12, 14, 5, 21, 21))]
    if est.devices > 1:
        lines.append(
            f"  mgpu_dp: card 0 is the fullest; the other cards peak near"
            f" {format_bytes(est.other_device_peak())} each."
        )
        if not est.inference:
            lines.append("  mgpu_ddp: includes one extra copy of the gradients (DDP's all-reduce buckets).")
        if global_batch and est.batch_size % est.devices:
            lines.append(
                f"  mgpu_ddp needs the global batch divisible by {est.devices}; {est.batch_size} is not."
            )
    lines += _sharded_lines(est, rows)
    lines += _nothing_fits(est, rows)
    lines.extend(f"  note: {note}" for note in est.notes)
    return "\n".join(lines)


def _sharded_lines(est: MemoryEstimate, rows: list[StrategyRow]) -> list[str]:
    """What each ``mgpu_fsdp`` device holds, and on how many devices the model fits."""
    if not est.unit_bytes:
        return []
    held = "parameters" if est.inference else "parameters, gradients and optimizer state"
    lines = []
    if est.devices > 1:
        lines.append(
            f"  mgpu_fsdp: {held} 1/{est.devices} each ({format_bytes(est.sharded_state_bytes())} of"
            f" {format_bytes(est.model_state_bytes)}, padding included),"
        )
        lines.append(
            f"    plus the largest of {len(est.unit_bytes)} unit(s) while gathered"
            f" ({format_bytes(est.largest_unit_bytes)})."
        )
    if est.device_memory is None:
        return lines
    batch = rows[-1].per_device_batch  # the mgpu_fsdp row's, or the single device's when there is one
    fewest = est.devices_to_fit(per_device_batch=batch)
    memory = format_bytes(est.device_memory)
    if fewest is None:
        lines.append(
            f"  mgpu_fsdp: no number of devices fits {batch} sample(s) per device in {memory}: the largest"
            " unit, the buffers and the activations alone exceed it (shard smaller blocks, or fewer samples)."
        )
    else:
        lines.append(
            f"  mgpu_fsdp fits {batch} sample(s) per device in {memory} from {fewest} device(s)"
            f" (peak {format_bytes(est.peak('mgpu_fsdp', batch, devices=fewest))} there)."
        )
    return lines


def _largest(value: int | None) -> str:
    return "none" if value == 0 else str(value)


def _per_sample(est: MemoryEstimate) -> str:
    """What one more sample on a device adds: the batch, then saved activations or the forward's peak."""
    held = (
        f"live at the forward's peak {format_bytes(est.forward_backward[1])} (the batch included)"
        if est.inference
        else f"activations saved for backward {format_bytes(est.activation_bytes_per_sample)}"
    )
    batch, outputs = format_bytes(est.batch_bytes_per_sample), format_bytes(est.output_bytes_per_sample)
    return f"batch {batch}, {held}, outputs {outputs}"


def _nothing_fits(est: MemoryEstimate, rows: list[StrategyRow]) -> list[str]:
    """Which strategies cannot take even one sample per device, and, when none can, what would."""
    if est.device_memory is None:
        return []
    refused = [row.strategy for row in rows if row.largest_per_device == 0]
    if not refused:
        return []
    log.debug("not even one sample per device fits under %s", ", ".join(refused))
    memory = format_bytes(est.device_memory)
    if len(refused) < len(rows):
        return [f"  {', '.join(refused)}: not even one sample per device fits in {memory}."]
    need = min(est.peak(row.strategy, per_device_batch=1) for row in rows)
    model = est.model_state_bytes + est.buffer_bytes
    held = "parameters and buffers" if est.inference else "parameters, gradients and optimizer state"
    lines = [
        f"  Nothing fits: one sample per device needs {format_bytes(need)},"
        f" more than the {memory} of a device.",
        "  What would fit:",
        f"  - devices with at least {format_bytes(need)} each;",
    ]
    fewest = est.devices_to_fit(per_device_batch=1) if est.unit_bytes else None
    if fewest is not None and fewest > est.devices:
        lines.append(
            f"  - strategy='mgpu_fsdp' on {fewest} devices: each holds 1/{fewest} of the model state;"
        )
    if model > est.device_memory:
        lines += [
            f"  - a smaller model: its {held} alone take {format_bytes(model)};",
            "    more devices do not help mgpu_dp and mgpu_ddp, which keep a whole copy on each device;",
        ]
    else:
        lines.append(
            "  - smaller samples (shorter sequences, smaller images): one sample's activations do not fit;"
        )
    if est.precision in ("32-true", "64-true"):
        lines += [
            f"  - lower precision: {est.precision} now; 'bf16-mixed' (or '16-mixed') about halves the"
            " activations,",
            "    'bf16-true' also halves the weights, gradients and optimizer state;",
        ]
    if est.optimizer_state_bytes:
        lines.append(
            f"  - an optimizer with less state: {est.optimizer} keeps"
            f" {format_bytes(est.optimizer_state_bytes)} (plain SGD keeps none);"
        )
    lines[-1] = lines[-1].rstrip(";") + "."
    return lines
