"""Build what a validated config describes: the recipe's module and data, logger and Trainer.

- ``resolve_devices`` turns ``devices: auto`` (or ``-1``) into every visible GPU, or on a machine
  without one into one CPU process per core, at most ``CPU_DEVICE_CAP`` (4).
- ``build_trainer`` gives the Trainer a ``CSVLogger`` writing ``<run_dir>/metrics.csv`` and, with
  strategy options (or ``trainer.micro_batch_size``) set, the registered strategy built with them; when
  standard output is not a terminal (``make demo > log``) progress comes as one line per epoch
  instead of a redrawn bar (``config/progress.py``), and Lightning's warnings about its own
  use of torch are hidden.

Lightning's configuration errors become ``ValueError`` so the command line prints them in one line.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, cast

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_mgpu.config.progress import hide_unactionable_warnings, progress_bar_for
from lightning_mgpu.config.schema import CPU_DEVICE_CAP, RunConfig
from lightning_mgpu.config.strategy import build_strategy
from lightning_mgpu.config.trainer import trainer_arguments

__all__ = [
    "build_data",
    "build_module",
    "build_trainer",
    "load_weights",
    "resolve_devices",
]

log = logging.getLogger(__name__)


def resolve_devices(accelerator: str, devices: Any) -> tuple[str, Any]:
    """``(accelerator, devices)`` with ``devices: auto`` made concrete.

    - a GPU accelerator (or ``auto``) with CUDA available: every visible GPU;
    - otherwise (``cpu``, or ``auto`` without CUDA): one CPU process per usable core, at most
      ``CPU_DEVICE_CAP``;
    - ``-1`` (Lightning's "all devices") means the same as ``auto``;
    - anything else is returned unchanged.

    Raises:
        ValueError: device indices (``[0, 3]``) where they cannot select a GPU: with the ``cpu``
            accelerator, or when no CUDA device is visible.

    Example::

        resolve_devices("auto", "auto")  # ('cpu', 2) on a two-core machine without GPU
    """
    if isinstance(devices, list):
        _check_indices(accelerator, devices)
        return accelerator, devices
    if devices not in ("auto", -1):
        return accelerator, devices
    if accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available():
        log.debug("devices=%s: every visible GPU (%d)", devices, torch.cuda.device_count())
        return ("gpu" if accelerator == "auto" else accelerator), torch.cuda.device_count()
    if accelerator in ("auto", "cpu"):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        log.debug("devices=%s: no GPU, %d usable cores, at most %d processes", devices, cores, CPU_DEVICE_CAP)
        return "cpu", max(1, min(cores, CPU_DEVICE_CAP))
    return accelerator, "auto"


def _check_indices(accelerator: str, devices: list[int]) -> None:
    """Lightning's words for indices on CPU ("should be an int > 0") do not say what is wrong."""
    if accelerator == "mps" or (accelerator == "auto" and torch.backends.mps.is_available()):
        return
    if accelerator == "cpu":
        why = "and trainer.accelerator is cpu"
    elif not torch.cuda.is_available():
        why = "and no CUDA device is visible here"
    else:
        return
    raise ValueError(
        f"trainer.devices={devices}: device indices select GPUs, {why};"
        " give a count such as trainer.devices=2 to run that many CPU processes"
    )


def build_module(cfg: RunConfig, with_weights: bool = True) -> L.LightningModule:
    """The recipe's LightningModule with the ``model`` section and the ``optimizer`` section, and the
    config's ``weights`` loaded unless ``with_weights=False`` (the memory estimate needs only the shapes).

    Example::

        model = build_module(load_config("digits"))
    """
    from lightning_mgpu.recipes import load_recipe

    module: L.LightningModule = load_recipe(cfg.recipe).module(
        **asdict(cfg.model), optimizer=asdict(cfg.optimizer)
    )
    if with_weights and cfg.weights is not None:
        load_weights(cast(torch.nn.Module, module.net), cfg.weights)
    return module


def build_data(cfg: RunConfig) -> L.LightningDataModule:
    """The recipe's LightningDataModule with the ``data`` section (its files are checked here, before launch).

    Example::

        data = build_data(load_config("mnist", ["data.root=/data/mnist"]))
    """
    from lightning_mgpu.recipes import load_recipe

    data: L.LightningDataModule = load_recipe(cfg.recipe).datamodule(**asdict(cfg.data))
    return data


def load_weights(net: torch.nn.Module, path: str | Path) -> None:
    """Load weights into ``net`` with ``lightning_mgpu.load_state_dict``, strictly.

    Takes ``.safetensors``, a ``.pt``/``.pth`` state_dict (torchvision's files) or a Lightning
    ``.ckpt`` of the recipe (its ``net.`` prefix is removed); nothing is unpickled beyond tensors.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the keys or shapes do not fit ``net`` (each problem listed).

    Example::

        load_weights(module.net, "resnet18-f37072fd.pth")
    """
    from lightning_mgpu.checkpoint.load import LoadError, load_state_dict

    try:
        load_state_dict(net, Path(path).expanduser(), strict=True)
    except LoadError as err:
        # the Python API's way out (strict=False) is not an option of a run: say what is
        hint = (
            f"weights= must fit the recipe's model as configured: `lightning-mgpu inspect {path}` shows"
            " what the file holds; set the model options it was trained with (such as model.num_classes)"
        )
        raise LoadError(f"{err.problems}\n{hint}", err.report) from None


def build_trainer(cfg: RunConfig, run_dir: Path, callbacks: list[Callback]) -> L.Trainer:
    """The Trainer of the ``trainer`` section, logging to ``<run_dir>/metrics.csv``.

    Raises:
        ValueError: Lightning refused the settings (e.g. ``devices=[3]`` on a machine with two GPUs).

    Example::

        trainer = build_trainer(cfg, run_dir, [])
    """
    t = cfg.trainer
    accelerator, devices = resolve_devices(t.accelerator, t.devices)
    kwargs = {**trainer_arguments(t), "accelerator": accelerator, "devices": devices}
    kwargs["strategy"] = build_strategy(t.strategy, t.micro_batch_size)
    hide_unactionable_warnings()
    bar = progress_bar_for(sys.stdout) if t.enable_progress_bar is not False else None  # null: Lightning's on
    callbacks = [*callbacks, bar] if bar is not None else callbacks
    try:
        return L.Trainer(
            callbacks=callbacks,
            logger=CSVLogger(run_dir, name="", version=""),
            default_root_dir=run_dir,
            enable_checkpointing=cfg.callbacks.checkpoint.enabled,
            **kwargs,
        )
    except (MisconfigurationException, TypeError) as err:  # Lightning's words for a setting it refuses
        raise ValueError(f"trainer: {err}") from err
