"""Recipe configs: parse (YAML, ``key=value`` overrides), validate (every error at once), instantiate.

``load_config`` does the first two steps::

    from lightning_mgpu.config import load_config

    cfg = load_config("digits", ["trainer.max_epochs=3"])  # a validated RunConfig
    cfg.trainer.max_epochs  # 3

Importing this package does not import torch; validating a config imports its recipe.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from lightning_mgpu.config.parse import find_config, load
from lightning_mgpu.config.schema import RunConfig
from lightning_mgpu.config.validate import ConfigError, validate

__all__ = ["ConfigError", "RunConfig", "find_config", "load_config"]


def load_config(config: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
    """Read ``config`` (a path or a shipped name), apply ``overrides`` and validate the result.

    Raises:
        FileNotFoundError: no such file or shipped config.
        ConfigError: the config does not fit the schema; the message lists every problem.

    Example::

        cfg = load_config("resnet18", ["model.arch=resnet50", "trainer.devices=[0,3]"])
    """
    return validate(load(config, overrides), source=str(config))
