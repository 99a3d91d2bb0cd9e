"""The ``callbacks`` section: one sub-section per callback, its keys read from the callback's signature.

- ``memory``: ``lightning_mgpu.DeviceMemoryMonitor`` (on by default);
- ``time``: ``lightning_mgpu.DeviceTimeMonitor`` (on by default);
- ``export``: ``lightning_mgpu.PlainStateDictExport``, plain weights next to each checkpoint (on);
- ``checkpoint``: Lightning's ``ModelCheckpoint``, writing to ``<run_dir>/checkpoints`` (on);
- ``early_stopping``: Lightning's ``EarlyStopping`` (off).

Each sub-section has an ``enabled`` switch and every keyword of its class's ``__init__`` (typed and
checked as the ``trainer`` keys are, ``config/trainer.py``) but those the run gives (``RUN_SETS``), with
the class's defaults unless ``CALLBACK_DEFAULTS`` gives the run's own. Its values are then checked by
building the callback once, so a callback's own checks speak (``ModelCheckpoint``'s ``mode``, the memory
monitor's ``every_n_steps``). ``build_callbacks`` builds the switched-on ones.

Importing this module does not import torch; building the schema imports the callbacks.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from pathlib import Path
from typing import Any

from lightning_mgpu.config.signature import checked, convert, fields, keywords, wrong_type

__all__ = ["CALLBACKS", "CALLBACK_DEFAULTS", "RUN_SETS", "build_callbacks", "callbacks_schema"]

CALLBACKS = {
    "memory": ("lightning_mgpu.callbacks.memory.DeviceMemoryMonitor", True),
    "time": ("lightning_mgpu.callbacks.time.DeviceTimeMonitor", True),
    "export": ("lightning_mgpu.callbacks.export.PlainStateDictExport", True),
    "checkpoint": ("lightning.pytorch.callbacks.ModelCheckpoint", True),
    "early_stopping": ("lightning.pytorch.callbacks.EarlyStopping", False),
}
"""Each sub-section's callback class and whether it is on by default, in the order the Trainer gets them."""

CALLBACK_DEFAULTS: dict[str, dict[str, Any]] = {
    "checkpoint": {"save_last": True},  # last.ckpt: what a stopped run resumes from
    "early_stopping": {"monitor": "val/loss"},  # every recipe logs val/loss
}
"""The run's defaults where they are not the callback class's."""

RUN_SETS = {
    "print_summary": "the run's closing summary shows the monitors' tables",
    "submodule": "the recipe's network is its module's net",
    "dirpath": "checkpoints go to <run_dir>/checkpoints",
}
"""Callback arguments the run gives, which no sub-section takes, and why."""


def _class(name: str) -> type:
    module, _, attr = CALLBACKS[name][0].rpartition(".")
    cls: type = getattr(importlib.import_module(module), attr)
    return cls


def _given(run_dir: Path) -> dict[str, Any]:
    return {"print_summary": False, "submodule": "net", "dirpath": run_dir / "checkpoints"}


@functools.cache
def callbacks_schema() -> type:
    """The ``callbacks`` section as a dataclass of one dataclass per callback.

    Example::

        OmegaConf.structured(callbacks_schema()).checkpoint.save_last  # True
    """
    sections = []
    for name, (_, enabled) in CALLBACKS.items():
        keys = fields(_class(name), RUN_SETS, CALLBACK_DEFAULTS.get(name, {}))
        section = dataclasses.make_dataclass(f"{name.title()}Config", [("enabled", bool, enabled), *keys])
        sections.append((name, section, dataclasses.field(default_factory=section)))
    return dataclasses.make_dataclass("CallbacksConfig", sections, namespace={"problems": _problems})


def build_callbacks(section: Any, run_dir: Path) -> list[Any]:
    """The callbacks a checked ``callbacks`` section switches on, writing under ``run_dir``.

    Example::

        callbacks = build_callbacks(cfg.callbacks, Path("runs/digits-1"))
    """
    return [_build(name, section, run_dir) for name in CALLBACKS if getattr(section, name).enabled]


def _build(name: str, section: Any, run_dir: Path) -> Any:
    cls = _class(name)
    params = keywords(cls)
    values = dataclasses.asdict(getattr(section, name))
    kwargs = {k: convert(v, params[k].annotation) for k, v in values.items() if k != "enabled"}
    return cls(**kwargs, **{k: v for k, v in _given(run_dir).items() if k in params})


def _problems(section: Any) -> list[str]:
    """Values the annotations refuse, else what each callback says of them, one message each."""
    out = []
    for name in CALLBACKS:
        params = keywords(_class(name))
        values = dataclasses.asdict(getattr(section, name))
        keys = [key for key in values if key != "enabled"]
        wrong = [p for key in keys for p in wrong_type(f"{name}.{key}", values[key], params[key].annotation)]
        out += wrong or checked(name, values, functools.partial(_build, name, section, Path("run")))
    return out
