"""``MemoryEstimate``: what ``estimate_memory`` measured, and each strategy's peak predicted from it.

Plain data in, plain numbers out: the peak of each strategy at any batch, the largest batch
that fits, and the fewest devices on which ``mgpu_fsdp`` fits (``lightning_mgpu._sharding.per_device``
holds its arithmetic).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from lightning_mgpu._sharding.per_device import fewest_devices, shard_share
from lightning_mgpu.devices import parse_bytes
from lightning_mgpu.estimate.report import format_estimate

__all__ = ["STRATEGIES", "MemoryEstimate"]

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
