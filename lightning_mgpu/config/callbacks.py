"""The ``callbacks`` section of a run config: one dataclass per callback, each with an ``enabled`` switch.

- ``memory``: ``lightning_mgpu.DeviceMemoryMonitor`` (on by default);
- ``time``: ``lightning_mgpu.DeviceTimeMonitor`` (on by default);
- ``export``: ``lightning_mgpu.PlainStateDictExport``, plain weights next to each checkpoint (on);
- ``checkpoint``: Lightning's ``ModelCheckpoint`` (on);
- ``early_stopping``: Lightning's ``EarlyStopping`` (off).

``config.instantiate.build_callbacks`` builds them. This module does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_mgpu.config.checks import at_least, one_of

__all__ = [
    "CallbacksConfig",
    "CheckpointConfig",
    "EarlyStoppingConfig",
    "ExportConfig",
    "MemoryConfig",
    "TimeConfig",
]

_MODES = ("min", "max")


@dataclass
class MemoryConfig:
    """``lightning_mgpu.DeviceMemoryMonitor``: per-device memory in the metrics, a summary JSON and a plot.

    Example::

        lightning-mgpu run digits callbacks.memory.every_n_steps=1
    """

    enabled: bool = True
    """Turn the monitor on or off. It records training (``task: fit``) only: with ``validate`` or ``predict``
    it records nothing, and validation warns."""
    every_n_steps: int = 10
    """Read memory every this many training steps."""
    imbalance_threshold: float = 1.25
    """Warn once when the fullest device's peak exceeds the mean peak by this factor."""

    def problems(self) -> list[str]:
        """Impossible values in this section, one message each."""
        return at_least("every_n_steps", self.every_n_steps, 1) + at_least(
            "imbalance_threshold", self.imbalance_threshold, 1.0, " (1.0 is perfectly balanced)"
        )


@dataclass
class TimeConfig:
    """``lightning_mgpu.DeviceTimeMonitor``: each rank's data loading, work and waiting; the slow rank named.

    Example::

        lightning-mgpu run digits callbacks.time.flush_every_n_steps=5
    """

    enabled: bool = True
    """Turn the monitor on or off. It times training (``task: fit``) only."""
    flush_every_n_steps: int = 25
    """Gather every rank's times and log their means every this many training batches."""

    def problems(self) -> list[str]:
        """Impossible values in this section, one message each."""
        return at_least("flush_every_n_steps", self.flush_every_n_steps, 1)


@dataclass
class ExportConfig:
    """``lightning_mgpu.PlainStateDictExport``: plain weights of the network next to every checkpoint.

    Example::

        lightning-mgpu run digits callbacks.export.dataparallel=true
    """

    enabled: bool = True
    """Turn the export on or off."""
    format: str = "safetensors"
    """``safetensors`` (no pickle, memory-mappable) or ``pt`` (``torch.save``)."""
    dataparallel: bool = False
    """Write keys with ``module.`` in front, the form ``nn.DataParallel(model).load_state_dict`` expects."""

    def problems(self) -> list[str]:
        """Impossible values in this section, one message each."""
        return one_of("format", self.format, ("safetensors", "pt"))


@dataclass
class CheckpointConfig:
    """Lightning's ``ModelCheckpoint``, writing to ``<run_dir>/checkpoints``.

    Example::

        lightning-mgpu run digits callbacks.checkpoint.save_top_k=3
    """

    enabled: bool = True
    """Turn checkpointing on or off."""
    monitor: str | None = None
    """Metric that picks the best checkpoint (e.g. ``val/acc``); ``null`` keeps the latest."""
    mode: str = "min"
    """``min`` or ``max``: whether a smaller or larger ``monitor`` is better."""
    save_top_k: int = 1
    """How many best checkpoints to keep (-1 keeps all)."""
    save_last: bool = True
    """Also keep ``last.ckpt``."""

    def problems(self) -> list[str]:
        """Impossible values in this section, one message each."""
        return one_of("mode", self.mode, _MODES) + at_least("save_top_k", self.save_top_k, -1)


@dataclass
class EarlyStoppingConfig:
    """Lightning's ``EarlyStopping``.

    Example::

        lightning-mgpu run digits callbacks.early_stopping.enabled=true
    """

    enabled: bool = False
    """Turn early stopping on or off."""
    monitor: str = "val/loss"
    """Metric to watch."""
    mode: str = "min"
    """``min`` or ``max``: whether a smaller or larger ``monitor`` is better."""
    patience: int = 3
    """Validation rounds without improvement before stopping."""

    def problems(self) -> list[str]:
        """Impossible values in this section, one message each."""
        return one_of("mode", self.mode, _MODES) + at_least("patience", self.patience, 0)


@dataclass
class CallbacksConfig:
    """The callbacks a run uses; each has an ``enabled`` switch.

    Example::

        lightning-mgpu run digits callbacks.memory.enabled=false
    """

    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """Per-device memory monitor (on by default)."""
    time: TimeConfig = field(default_factory=TimeConfig)
    """Per-rank time monitor (on by default)."""
    export: ExportConfig = field(default_factory=ExportConfig)
    """Plain weights export (on by default)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints (on by default)."""
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    """Early stopping (off by default)."""
