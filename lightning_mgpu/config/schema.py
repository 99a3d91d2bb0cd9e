"""The schema every recipe config follows: dataclasses, one docstring per field.

A run config has the sections ``trainer``, ``model``, ``data``, ``optimizer`` and
``callbacks`` plus a few top-level keys. ``model`` and the recipe-specific part of
``data`` come from the recipe (its ``ModelConfig`` and ``DataConfig``), ``trainer`` and
``callbacks`` from the signatures of Lightning's ``Trainer`` and of the callbacks
(``config/trainer.py``, ``config/callbacks.py``); the rest is defined here, with the ``optimizer``
section in ``config/optimizer.py`` (importable from here). Types are checked by omegaconf; each
dataclass's ``problems()`` lists impossible values (it never raises, so every mistake is reported
at once).

This module does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from lightning_mgpu.config.checks import at_least, minimums, one_of
from lightning_mgpu.config.optimizer import OptimizerConfig

__all__ = [
    "CPU_DEVICE_CAP",
    "DataConfig",
    "OptimizerConfig",
    "RunConfig",
    "SplitDataConfig",
    "at_least",
    "minimums",
]

CPU_DEVICE_CAP = 4
"""``trainer.devices: auto`` on a machine without a GPU starts one process per core, at most this many."""

_TASKS = ("fit", "validate", "predict")


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
    trainer: Any = field(default_factory=dict)
    """The keyword arguments of ``lightning.pytorch.Trainer`` (``config/trainer.py`` reads them from its
    signature), with the run's defaults."""
    model: Any = field(default_factory=dict)
    """The recipe's model settings (its ``ModelConfig``)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Data settings (the recipe's ``DataConfig``)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer settings."""
    callbacks: Any = field(default_factory=dict)
    """One sub-section per callback, its keys the callback's ``__init__``'s (``config/callbacks.py``)."""

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
