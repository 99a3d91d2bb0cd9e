"""``MemoryEstimate``: what ``estimate_memory`` measured, each strategy's peak predicted from it, its report.

Plain data in, plain numbers out: the peak of each strategy at any batch, the largest batch that fits,
the fewest devices on which ``mgpu_fsdp`` fits (``lightning_mgpu._sharding.per_device`` holds its
arithmetic), and ``format_estimate``, the one table of them (``str(estimate)``, ``lightning-mgpu estimate``):
a row per strategy (``strategy_rows``) under what was measured, with notes and, when not even one sample
per device fits, what would.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from lightning_mgpu._sharding.per_device import fewest_devices, shard_share
from lightning_mgpu._words import aligned
from lightning_mgpu.devices import format_bytes, parse_bytes

__all__ = ["STRATEGIES", "MemoryEstimate", "StrategyRow", "format_estimate", "strategy_rows"]

STRATEGIES = ("single", "mgpu_dp", "mgpu_ddp", "mgpu_fsdp")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted per-device memory of one training step (or of inference); ``str()`` gives a readable report.

    Byte counts are for one copy of the model; ``*_per_sample`` fields scale with the
    batch on a device. ``forward_backward`` and ``optimizer_step`` hold the peak of each
    phase as ``(fixed, per_sample)`` bytes, both including the parameters, buffers,
    gradients, optimizer state and the batch that are alive at that time. For an
    ``inference`` estimate gradients, optimizer state and saved activations are zero and
    ``forward_backward`` is the forward's peak without gradients.

    Example::

        import torch
        from torch import nn
        from lightning_mgpu import estimate_memory

        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
        est = estimate_memory(model, torch.randn(16, 32), devices=4, device_memory="24GiB")
        print(est)
        est.peak("mgpu_ddp")                  # bytes on each device under mgpu_ddp
        est.peak("mgpu_fsdp", devices=8)      # ... under mgpu_fsdp on 8 devices
        est.largest_per_device_batch("single")
        est.devices_to_fit()                  # fewest devices mgpu_fsdp needs: 1 here
    """

    model: str
    batch_size: int
    """The batch each process's DataLoader yields (per device under ``mgpu_ddp``, split under ``mgpu_dp``)."""
    devices: int
    device_memory: int | None
    measured_on: str
    precision: str
    optimizer: str
    parameter_bytes: int
    buffer_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    batch_bytes_per_sample: float
    activation_bytes_per_sample: float
    output_bytes_per_sample: float
    forward_backward: tuple[float, float]
    optimizer_step: tuple[float, float]
    notes: tuple[str, ...] = field(default_factory=tuple)
    inference: bool = False
    """Whether this is the memory of inference (``predict``/``validate``) rather than of training."""
    parameter_rows: tuple[tuple[int, int], ...] = ()
    """``(rows, bytes per row)`` of each parameter: what ``mgpu_fsdp`` splits over the devices."""
    unit_bytes: tuple[int, ...] = ()
    """Bytes of each ``mgpu_fsdp`` unit's parameters once gathered (its blocks, then the root)."""

    @property
    def model_state_bytes(self) -> int:
        """Parameters, gradients and optimizer state: what ``mgpu_fsdp`` shards."""
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_state_bytes

    @property
    def largest_unit_bytes(self) -> int:
        """The largest ``mgpu_fsdp`` unit's parameters, gathered whole for its forward and backward."""
        return max(self.unit_bytes, default=0)

    def sharded_state_bytes(self, devices: int | None = None) -> int:
        """Model state on the fullest device under ``mgpu_fsdp`` over ``devices`` (default: the estimate's).

        Gradients and optimizer state are sharded like their parameters, so the padding of
        dim 0 to a multiple of ``devices`` weighs on them in the same proportion.
        """
        n = self.devices if devices is None else devices
        if not self.parameter_rows:
            return self.model_state_bytes  # nothing to shard
        return math.ceil(self.model_state_bytes * shard_share(self.parameter_rows, n))

    def per_device_batch(self, strategy: str = "single") -> int:
        """The batch on each device under ``strategy`` at the configured batch size."""
        _check_strategy(strategy)
        if strategy == "mgpu_dp":
            return math.ceil(self.batch_size / self.devices)
        return self.batch_size

    def _slope_and_fixed(self, strategy: str, devices: int | None = None) -> list[tuple[float, float]]:
        _check_strategy(strategy)  # also where no default batch is read: a given batch, the largest batch
        fb, step = self.forward_backward, self.optimizer_step
        if strategy == "mgpu_fsdp":
            # the model state shrinks to the shards; forward and backward gather one unit at a time
            saved = self.model_state_bytes - self.sharded_state_bytes(devices)
            share = 1 - saved / self.model_state_bytes if self.model_state_bytes else 1.0
            # the optimizer updates the shards: its temporaries shrink with them, the buffers do not
            on_shards = self.buffer_bytes + (step[0] - self.buffer_bytes) * share
            return [(fb[0] - saved + self.largest_unit_bytes, fb[1]), (on_shards, step[1])]
        if strategy == "mgpu_ddp":
            # DDP keeps a bucket copy of every gradient for its all-reduce
            return [(fb[0] + self.gradient_bytes, fb[1]), (step[0] + self.gradient_bytes, step[1])]
        if strategy == "mgpu_dp":
            # card 0 receives the whole batch before scattering it and gathers every replica's outputs
            batch = (self.devices - 1) * self.batch_bytes_per_sample
            outputs = self.devices * self.output_bytes_per_sample
            return [(fb[0], fb[1] + batch + outputs), (step[0], step[1] + batch)]
        return [fb, step]

    def peak(
        self, strategy: str = "single", per_device_batch: int | None = None, devices: int | None = None
    ) -> int:
        """Predicted peak bytes on the fullest device (card 0 under ``mgpu_dp``).

        Args:
            strategy: ``"single"``, ``"mgpu_dp"``, ``"mgpu_ddp"`` or ``"mgpu_fsdp"``.
            per_device_batch: samples on each device; defaults to the configured batch.
            devices: processes ``mgpu_fsdp`` shards over; defaults to the estimate's ``devices``.
        """
        b = self.per_device_batch(strategy) if per_device_batch is None else per_device_batch
        return int(max(fixed + slope * b for fixed, slope in self._slope_and_fixed(strategy, devices)))

    def devices_to_fit(
        self, device_memory: int | str | None = None, per_device_batch: int | None = None
    ) -> int | None:
        """The fewest devices on which ``mgpu_fsdp``'s predicted peak fits; ``None`` when no count does.

        No count does when the largest unit, the buffers and one device's activations alone
        exceed the memory: shard smaller blocks (``block_classes=``) or use a smaller batch.

        Args:
            device_memory: memory of one device; defaults to the one given to ``estimate_memory``.
            per_device_batch: samples on each device; defaults to the configured batch.

        Raises:
            ValueError: if no device memory was given here or to ``estimate_memory``.
        """
        memory = self._memory(device_memory)
        fewest = fewest_devices(lambda n: self.peak("mgpu_fsdp", per_device_batch, devices=n) <= memory)
        log.debug("mgpu_fsdp fits %d bytes per device from %s device(s)", memory, fewest)
        return fewest

    def _memory(self, device_memory: int | str | None) -> int:
        memory = self.device_memory if device_memory is None else parse_bytes(device_memory)
        if memory is None:
            raise ValueError("no device memory to fit: pass device_memory='12GiB' (or a number of bytes)")
        return memory

    def other_device_peak(self, per_device_batch: int | None = None) -> int:
        """Predicted peak on each ``mgpu_dp`` replica other than card 0.

        A replica holds a broadcast copy of the parameters and buffers, its slice of
        the batch, its saved activations and, during backward, its gradients; in
        inference, its forward's peak.
        """
        b = self.per_device_batch("mgpu_dp") if per_device_batch is None else per_device_batch
        static = self.parameter_bytes + self.buffer_bytes + self.gradient_bytes
        if self.inference:
            return int(static + b * self.forward_backward[1])
        return int(static + b * (self.batch_bytes_per_sample + self.activation_bytes_per_sample))

    def largest_per_device_batch(
        self, strategy: str = "single", device_memory: int | str | None = None
    ) -> int:
        """The largest batch per device whose predicted peak fits; 0 when not even one sample fits.

        Args:
            strategy: ``"single"``, ``"mgpu_dp"`` (card 0, the fullest), ``"mgpu_ddp"`` or ``"mgpu_fsdp"``.
            device_memory: memory of one device; defaults to the one given to ``estimate_memory``.

        Raises:
            ValueError: if no device memory was given here or to ``estimate_memory``.
        """
        memory = self._memory(device_memory)
        best = math.inf
        for fixed, slope in self._slope_and_fixed(strategy):
            if fixed + slope > memory:
                return 0
            if slope > 0:
                best = min(best, math.floor((memory - fixed) / slope))
        return int(best) if math.isfinite(best) else 1 << 31

    def __str__(self) -> str:
        return format_estimate(self)


def _check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")


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
    largest_per_device: int | None
    """The largest batch per device that fits (0: not even one sample); ``None`` without memory."""

    @property
    def largest_global(self) -> int | None:
        return None if self.largest_per_device is None else self.largest_per_device * self.devices


def strategy_rows(est: MemoryEstimate, *, global_batch: bool = False) -> list[StrategyRow]:
    """Each strategy's row; ``global_batch`` reads ``est.batch_size`` as split over the devices by all.

    With one device only the ``single`` row is given: the others would run the same step.
    """
    n, memory = est.devices, est.device_memory
    split = est.per_device_batch("mgpu_dp")  # its largest chunk
    # each mgpu_ddp / mgpu_fsdp process loads the DataLoader's whole batch, or its share of a global one
    per_process = est.batch_size // n if global_batch else est.batch_size
    shapes = [("single", est.batch_size, 1), ("mgpu_dp", split, n), ("mgpu_ddp", per_process, n)]
    if est.unit_bytes:  # a model with parameters: mgpu_fsdp has something to shard
        shapes.append(("mgpu_fsdp", per_process, n))
    rows = []
    for strategy, per_device, devices in shapes[: 1 if n == 1 else None]:
        rows.append(
            StrategyRow(
                strategy=strategy,
                per_device_batch=per_device,
                global_batch=est.batch_size if strategy == "mgpu_dp" else per_device * devices,
                devices=devices,
                peak=est.peak(strategy, per_device_batch=per_device),
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
    if est.device_memory:
        cells[0] += ["fits", "largest batch/device", "largest global batch"]
        for cell, r in zip(cells[1:], rows, strict=True):
            cell += [
                "yes" if r.peak <= est.device_memory else "NO",
                _largest(r.largest_per_device),
                _largest(r.largest_global),
            ]
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
        lines += [
            f"  mgpu_fsdp: {held} 1/{est.devices} each ({format_bytes(est.sharded_state_bytes())} of"
            f" {format_bytes(est.model_state_bytes)}, padding included),",
            f"    plus the largest of {len(est.unit_bytes)} unit(s) while gathered"
            f" ({format_bytes(est.largest_unit_bytes)}).",
        ]
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
