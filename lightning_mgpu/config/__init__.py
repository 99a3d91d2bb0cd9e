"""Recipe configs: parse (YAML, ``key=value`` overrides), validate (every error at once), instantiate.

- ``schema.py``: the run config's dataclasses, the one source of defaults (``RunConfig``,
  ``DataConfig``). Three sections are read from signatures through ``signature.py``: ``trainer``
  from Lightning's ``Trainer`` (``trainer.py``, the run's defaults in ``TRAINER_DEFAULTS``), its
  ``strategy`` options from the strategy class (``strategy.py``) and each ``callbacks`` sub-section
  from its callback (``callbacks.py``). The ``optimizer`` section lives in ``optimizer.py`` (a class
  path such as ``torch.optim.AdamW``, checked and built there); ``checks.py`` holds the small value
  checks the sections share.
- ``parse.py``: finding a shipped config or a file, reading overrides, merging them.
- ``validate.py``: unknown keys with "did you mean", wrong types, impossible values, in one error.
- ``instantiate.py``: the recipe's module and data, callbacks, logger and Trainer; ``progress.py``:
  one progress line per epoch where standard output is not a terminal.

``load_config`` does the first two steps::

    from lightning_mgpu.config import load_config

    cfg = load_config("digits", ["trainer.max_epochs=3"])  # a validated RunConfig
    cfg.trainer.max_epochs  # 3

Importing this package does not import torch; validating a config imports its recipe.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from lightning_mgpu.config.parse import load
from lightning_mgpu.config.schema import RunConfig
from lightning_mgpu.config.validate import ConfigError, validate

__all__ = ["ConfigError", "RunConfig", "load_config"]


def load_config(config: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
    """Read ``config`` (a path or a shipped name), apply ``overrides`` and validate the result.

    Raises:
        FileNotFoundError: no such file or shipped config.
        ConfigError: the config does not fit the schema; the message lists every problem.

    Example::

        cfg = load_config("resnet18", ["model.arch=resnet50", "trainer.devices=[0,3]"])
    """
    return validate(load(config, overrides), source=str(config))
