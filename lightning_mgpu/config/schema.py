"""The schema every recipe config follows: dataclasses, one docstring per field.

A run config has the sections ``trainer``, ``model``, ``data``, ``optimizer`` and
``callbacks`` plus a few top-level keys. ``model`` and the recipe-specific part of
``data`` come from the recipe (its ``ModelConfig`` and ``DataConfig``); the rest is
defined here, with the ``optimizer`` section in ``config/optimizer.py`` and the ``callbacks``
sections in ``config/callbacks.py`` (both importable from here). Types are checked by omegaconf;
each dataclass's ``problems()`` lists impossible values (it never raises, so every mistake is
reported at once). Precision names come from ``lightning_mgpu.precision``.

This module does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from lightning_mgpu.config.callbacks import (
    CallbacksConfig,
    CheckpointConfig,
    EarlyStoppingConfig,
    ExportConfig,
    MemoryConfig,
)
from lightning_mgpu.config.checks import at_least, batch_limit, minimums, one_of
from lightning_mgpu.config.optimizer import OptimizerConfig
from lightning_mgpu.precision import precision_names

__all__ = [
    "CPU_DEVICE_CAP",
    "CallbacksConfig",
    "CheckpointConfig",
    "DataConfig",
    "EarlyStoppingConfig",
    "ExportConfig",
    "MemoryConfig",
    "OptimizerConfig",
    "RunConfig",
    "SplitDataConfig",
    "TrainerConfig",
    "at_least",
    "minimums",
]

CPU_DEVICE_CAP = 4
"""``trainer.devices: auto`` on a machine without a GPU starts one process per core, at most this many."""

_ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps")
_TASKS = ("fit", "validate", "predict")


@dataclass
class TrainerConfig:
    """Arguments of ``lightning.Trainer``; names and meanings are Lightning's.

    Example::

        lightning-mgpu run digits trainer.devices=[0,3] trainer.precision=bf16-mixed
    """

    accelerator: str = "auto"
    """``cpu``, ``gpu`` (same as ``cuda``), ``mps``, or ``auto`` (a GPU when one is visible)."""
    strategy: Any = "mgpu_auto"
    """A registered strategy: ``mgpu_auto`` (picks DDP, DP or one device), ``mgpu_ddp``, ``mgpu_dp``, ...;
    or a mapping of ``name:`` and any keyword the strategy's class takes, checked against its ``__init__``:
    ``{name: mgpu_ddp, stall_timeout: 60, micro_batch_size: auto}`` (``config/strategy.py``)."""
    devices: Any = "auto"
    """``auto`` or ``-1`` (every visible GPU; without a GPU one CPU process per core, at most 4), a count
    such as ``2``, or GPU indices such as ``[0, 3]`` (on a machine without GPU give a count)."""
    num_nodes: int = 1
    """Machines taking part (DDP only)."""
    precision: str = "32-true"
    """``32-true``, ``16-mixed``, ``bf16-mixed``, ... as Lightning spells them (listed in
    ``lightning_mgpu.precision``)."""
    max_epochs: int = 10
    """Stop after this many epochs (-1: no limit)."""
    max_steps: int = -1
    """Stop after this many optimizer steps (-1: no limit)."""
    fast_dev_run: Any = False
    """``true`` (or a batch count): run that many batches of each loop once, as a smoke test."""
    limit_train_batches: Any = None
    """Use only this many training batches per epoch (an int), or this fraction of them (a float)."""
    limit_val_batches: Any = None
    """The same for validation batches."""
    limit_predict_batches: Any = None
    """The same for prediction batches."""
    check_val_every_n_epoch: int = 1
    """Validate every this many epochs."""
    log_every_n_steps: int = 10
    """Write training metrics every this many steps."""
    accumulate_grad_batches: int = 1
    """Sum gradients over this many batches before each optimizer step."""
    gradient_clip_val: float | None = None
    """Clip gradients to this norm; ``null`` does not clip."""
    micro_batch_size: Any = None
    """Short for ``trainer.strategy.micro_batch_size``, passed to the ``mgpu_*`` strategy: each batch runs
    forward and backward in micro-batches of this many rows, one optimizer step per batch; ``auto`` runs
    whole batches and halves them on out-of-memory; ``null``: off."""
    deterministic: bool = False
    """Ask torch for deterministic algorithms (slower on GPUs)."""
    num_sanity_val_steps: int = 0
    """Validation batches run before training to catch bugs early (0 skips it)."""
    enable_progress_bar: bool = True
    """Show Lightning's progress bar."""
    enable_model_summary: bool = True
    """Print the table of layers and parameter counts before training."""

    def problems(self) -> list[str]:
        """Impossible values in this section, one message each."""
        out = one_of("accelerator", self.accelerator, _ACCELERATORS)
        out += one_of("precision", self.precision, precision_names())
        out += _devices_problems(self.devices)
        out += at_least("num_nodes", self.num_nodes, 1)
        out += at_least("max_epochs", self.max_epochs, -1, " (-1 means no limit)")
        out += at_least("max_steps", self.max_steps, -1, " (-1 means no limit)")
        if self.max_epochs == 0 or self.max_steps == 0:
            out.append("max_epochs/max_steps: 0 trains nothing; use -1 for no limit")
        fdr = self.fast_dev_run
        if not (isinstance(fdr, bool) or (isinstance(fdr, int) and fdr >= 1)):
            out.append(f"fast_dev_run: expected true, false or a batch count >= 1, got {fdr!r}")
        for name in ("limit_train_batches", "limit_val_batches", "limit_predict_batches"):
            out += batch_limit(name, getattr(self, name))
        out += at_least("check_val_every_n_epoch", self.check_val_every_n_epoch, 1)
        out += at_least("log_every_n_steps", self.log_every_n_steps, 1)
        out += at_least("accumulate_grad_batches", self.accumulate_grad_batches, 1)
        out += at_least("gradient_clip_val", self.gradient_clip_val, 0.0)
        out += at_least("num_sanity_val_steps", self.num_sanity_val_steps, -1, " (-1 runs them all)")
        return out


def _devices_problems(devices: Any) -> list[str]:
    if devices == "auto":
        return []
    if isinstance(devices, bool):
        return [f"devices: expected 'auto', a count or a list of indices, got {devices!r}"]
    if isinstance(devices, int):
        return (
            [] if devices >= 1 or devices == -1 else [f"devices: must be >= 1 (or -1 for all), got {devices}"]
        )
    if isinstance(devices, list):
        if not devices:
            return ["devices: an empty list selects no device; give indices such as [0, 1]"]
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices):
            return [f"devices: indices must be integers >= 0, got {devices}"]
        if len(set(devices)) != len(devices):
            return [f"devices: each index may appear once, got {devices}"]
        return []
    return [f"devices: expected 'auto', a count or a list of indices such as [0, 3], got {devices!r}"]


@dataclass
class DataConfig:
    """Loader settings every recipe shares; a recipe's ``DataConfig`` adds its own fields.

    Example::

        lightning-mgpu run digits data.batch_size=256 data.num_workers=4
    """

    batch_size: int = 64
    """The GLOBAL batch per optimizer step, as with ``nn.DataParallel``: ``mgpu_dp`` loads it whole and splits
    it over the devices; under ``mgpu_ddp`` each of N processes loads ``batch_size / N``."""
    num_workers: int = 0
    """Loader worker processes per training process (0 loads in the main process)."""
    shuffle: bool = True
    """Shuffle the training set every epoch."""
    seed: int = 0
    """Seed of the synthetic data and of the train/validation split, independent of the run's ``seed``."""

    def problems(self) -> list[str]:
        """Impossible values in this section, one message each."""
        return at_least("batch_size", self.batch_size, 1) + at_least("num_workers", self.num_workers, 0)


@dataclass
class SplitDataConfig(DataConfig):
    """``DataConfig`` for data split once into train and validation sets.

    Example::

        lightning-mgpu run digits data.val_fraction=0.1
    """

    val_fraction: float = 0.2
    """Share of the samples held out for validation."""

    def problems(self) -> list[str]:
        """Impossible values in this section, one message each."""
        out = super().problems()
        if not 0.0 < self.val_fraction < 1.0:
            out.append(f"val_fraction: must be between 0 and 1, got {self.val_fraction:g}")
        return out


@dataclass
class RunConfig:
    """A whole run: which recipe, what to do, and every section.

    Example::

        lightning-mgpu run digits task=validate weights=runs/digits-1/checkpoints/final.safetensors
    """

    recipe: str = MISSING
    """The recipe to run; ``lightning-mgpu recipes`` lists them."""
    task: str = "fit"
    """``fit`` (train and validate), ``validate``, or ``predict`` (writes ``predictions.csv``)."""
    seed: int | None = 0
    """Seed of model initialisation and shuffling (``null``: not seeded)."""
    run_dir: str | None = None
    """Folder for this run's outputs, new or empty: one that already holds files is refused, so runs never
    mix; ``null`` makes ``runs/<recipe>-<date>-<time>`` in the current folder."""
    weights: str | None = None
    """Weights to load into the recipe's network before the task: ``.safetensors``, a ``.pt``/``.pth``
    state_dict (e.g. torchvision's) or a Lightning ``.ckpt``."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Trainer settings."""
    model: Any = field(default_factory=dict)
    """The recipe's model settings (its ``ModelConfig``)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Data settings (the recipe's ``DataConfig``)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer settings."""
    callbacks: CallbacksConfig = field(default_factory=CallbacksConfig)
    """Callback settings."""

    def problems(self) -> list[str]:
        """Impossible values and combinations at the top level, one message each."""
        out = one_of("task", self.task, _TASKS)
        t = self.trainer
        unlimited = t.max_steps == -1 and t.max_epochs == -1 and not t.fast_dev_run
        if self.task == "fit" and self.optimizer.scheduler == "cosine" and unlimited:
            out.append(
                "optimizer.scheduler: cosine decays over the run's steps, so it needs trainer.max_steps or"
                " trainer.max_epochs (both are -1); set one, or optimizer.scheduler=none"
            )
        return out
