"""The ``trainer`` section: the keyword arguments of ``lightning.pytorch.Trainer``, read from its signature.

Every keyword ``Trainer(...)`` takes is a key, typed by its annotation, with Lightning's default unless
``TRAINER_DEFAULTS`` gives the run's own; nothing lists them by hand, so ``trainer.detect_anomaly=true``
or ``trainer.val_check_interval=0.5`` works as in Python, and a misspelt key gets "did you mean".

- ``trainer_schema()`` builds the section's dataclass: a key of one plain type (``int``, ``bool``,
  ``str``, optional or not; a ``Literal`` of names is a ``str``) is typed for omegaconf, any other
  (``devices``, ``limit_train_batches``, ``max_time``) takes any value and ``trainer_problems`` checks it
  against its annotation. Keys the run sets itself (``RUN_OWNED``) are not keys: the message says where
  to set them. ``micro_batch_size`` is added: the short form of ``trainer.strategy.micro_batch_size``.
- ``trainer_problems`` adds the checks of values the run relies on (devices, precision, batch limits,
  lower bounds), with messages that name the fix; Lightning checks the other values when it builds the
  Trainer.
- ``trainer_arguments`` gives ``Trainer(...)`` each key, converted as its annotation says (seconds
  become a ``timedelta`` for ``max_time``).

Importing this module does not import torch; building the schema imports Lightning.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from lightning_mgpu.config.checks import at_least, one_of
from lightning_mgpu.config.signature import convert, fields, keywords, wrong_type
from lightning_mgpu.precision import precision_names

__all__ = ["RUN_OWNED", "TRAINER_DEFAULTS", "trainer_arguments", "trainer_problems", "trainer_schema"]

TRAINER_DEFAULTS: dict[str, Any] = {
    "strategy": "mgpu_auto",  # DDP for several devices from a script, DP in a notebook, plain for one
    "max_epochs": 10,  # Lightning's 1000 is far beyond what a recipe needs
    "log_every_n_steps": 10,  # a recipe's epoch is a few dozen steps: every 50 draws too few points
    "num_sanity_val_steps": 0,  # the recipes' validation is tested; training starts at once
    # what Lightning's None means, written out in the printed config
    "precision": "32-true",
    "deterministic": False,
    "enable_progress_bar": True,
    "enable_model_summary": True,
}
"""The run's defaults where they are not Lightning's; every other key has the default of ``Trainer``."""

RUN_OWNED = {
    "callbacks": "the callbacks section turns callbacks on (callbacks.early_stopping.enabled=true, ...)",
    "logger": "the run logs every metric to <run_dir>/metrics.csv",
    "default_root_dir": "set run_dir, the folder of the run's files",
    "enable_checkpointing": "set callbacks.checkpoint.enabled",
}
"""``Trainer`` arguments the run sets itself, and where a config says what it wants instead."""

_ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps")
_MINIMUMS = {  # name: (lowest value, note)
    "num_nodes": (1, ""),
    "max_epochs": (-1, " (-1 means no limit)"),
    "max_steps": (-1, " (-1 means no limit)"),
    "check_val_every_n_epoch": (1, ""),
    "log_every_n_steps": (1, ""),
    "accumulate_grad_batches": (1, ""),
    "gradient_clip_val": (0, ""),
    "num_sanity_val_steps": (-1, " (-1 runs them all)"),
    "fast_dev_run": (0, " (true or a batch count runs that many batches, as a test)"),
}


@functools.cache
def trainer_keys() -> dict[str, Any]:
    """Each key of the section and its annotation, in the order of ``Trainer``'s signature."""
    from lightning.pytorch import Trainer

    return {n: p.annotation for n, p in keywords(Trainer).items() if n not in RUN_OWNED}


@functools.cache
def trainer_schema() -> type:
    """The ``trainer`` section as a dataclass: one field per key, the run's defaults, then Lightning's.

    Example::

        OmegaConf.structured(trainer_schema()).max_epochs  # 10
    """
    from lightning.pytorch import Trainer

    keys = fields(Trainer, RUN_OWNED, TRAINER_DEFAULTS)
    # strategy: a name or a mapping of its options, which config/strategy.py checks, as micro_batch_size
    keys = [(n, Any, f) if n == "strategy" else (n, t, f) for n, t, f in keys]
    keys.append(("micro_batch_size", Any, None))
    return dataclasses.make_dataclass("TrainerConfig", keys, namespace={"problems": trainer_problems})


def trainer_problems(section: Any) -> list[str]:
    """Values of the ``trainer`` section its annotations or the run refuse, one message each.

    ``strategy`` and ``micro_batch_size`` are checked by ``config.strategy.strategy_problems``.
    """
    out = []
    for name, hint in trainer_keys().items():
        value = getattr(section, name)
        if name in _VALUE_CHECKS:
            out += _VALUE_CHECKS[name](name, value)
        elif name.startswith("limit_"):
            out += _batch_limit(name, value)
        elif name != "strategy":
            if wrong := wrong_type(name, value, hint):
                out += wrong
            elif name in _MINIMUMS:
                out += at_least(name, value, *_MINIMUMS[name])
    if section.max_epochs == 0 or section.max_steps == 0:
        out.append("max_epochs/max_steps: 0 trains nothing; use -1 for no limit")
    return out


def trainer_arguments(section: Any) -> dict[str, Any]:
    """``Trainer(...)``'s keyword arguments from a checked ``trainer`` section, but ``strategy``
    (``config.strategy.build_strategy`` builds it)."""
    keys = trainer_keys().items()
    return {name: convert(getattr(section, name), hint) for name, hint in keys if name != "strategy"}


def _devices(name: str, devices: Any) -> list[str]:
    if devices == "auto":
        return []
    if isinstance(devices, int) and not isinstance(devices, bool):
        return (
            [] if devices >= 1 or devices == -1 else [f"{name}: must be >= 1 (or -1 for all), got {devices}"]
        )
    if isinstance(devices, list):
        if not devices:
            return [f"{name}: an empty list selects no device; give indices such as [0, 1]"]
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices):
            return [f"{name}: indices must be integers >= 0, got {devices}"]
        if len(set(devices)) != len(devices):
            return [f"{name}: each index may appear once, got {devices}"]
        return []
    return [f"{name}: expected 'auto', a count or a list of indices such as [0, 3], got {devices!r}"]


def _batch_limit(name: str, value: Any) -> list[str]:
    """``limit_*_batches``: None, a batch count (int >= 0) or a fraction in [0, 1]."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return []
    if isinstance(value, float) and 0.0 <= value <= 1.0:
        return []
    return [f"{name}: expected a batch count (int >= 0) or a fraction in [0.0, 1.0], got {value!r}"]


_VALUE_CHECKS = {
    "accelerator": lambda name, value: one_of(name, value, _ACCELERATORS),
    "precision": lambda name, value: one_of(name, value, precision_names()),
    "devices": _devices,
}
