"""Read a config: find the YAML (a path or a shipped name), load it, apply ``key=value`` overrides.

- ``find_config("digits")`` finds the shipped ``digits.yaml``; a path is used as given.
- ``parse_overrides(["trainer.devices=[0,3]", "data.batch_size=128"])`` reads each value
  as YAML, so ``[0,3]`` is a list, ``128`` an int and ``null`` is None.
- ``load(config, overrides)`` merges them, overrides last. Nothing is checked against the
  schema here; ``validate`` does that. ``trainer.strategy: NAME`` is read as ``{name: NAME}`` for
  the merge, so ``trainer.strategy.stall_timeout=60`` adds an option to the file's strategy, and
  ``trainer.strategy=OTHER`` starts from OTHER's defaults.

This module does not import torch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import cast

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lightning_mgpu.config.checks import did_you_mean
from lightning_mgpu.config.strategy import align_strategy, name_only, name_override

__all__ = ["find_config", "load", "parse_overrides", "shipped_configs"]

log = logging.getLogger(__name__)


def shipped_configs() -> dict[str, Path]:
    """Every shipped config by name: its path below the config folder (``recipes.CONFIG_DIR``, in the
    installed package or the checkout's ``recipes/configs``) without ``.yaml``, e.g. ``digits``."""
    from lightning_mgpu.recipes import CONFIG_DIR

    return {
        p.relative_to(CONFIG_DIR).with_suffix("").as_posix(): p for p in sorted(CONFIG_DIR.rglob("*.yaml"))
    }


def find_config(name_or_path: str) -> Path:
    """The YAML file for ``name_or_path``: an existing file, else a shipped config of that name.

    Raises:
        FileNotFoundError: neither a file nor a shipped name; the message lists the shipped names.

    Example::

        find_config("digits")            # the shipped recipes/configs/digits.yaml
        find_config("my_runs/big.yaml")  # a file of yours
    """
    path = Path(name_or_path)
    if path.is_file():
        log.debug("config %r: an existing file", name_or_path)
        return path
    shipped = shipped_configs()
    if name_or_path in shipped:
        log.debug("config %r: no such file, the shipped %s", name_or_path, shipped[name_or_path])
        return shipped[name_or_path]
    hint = did_you_mean(name_or_path, shipped)
    raise FileNotFoundError(
        f"no config file {name_or_path!r} and no shipped config of that name; {hint}"
        f"shipped configs: {', '.join(shipped)}"
    )


def parse_overrides(overrides: Sequence[str]) -> DictConfig:
    """``key=value`` strings as one nested config; each value is read as YAML.

    Raises:
        ValueError: an override without ``=`` or a value that is not valid YAML.

    Example::

        parse_overrides(["trainer.max_epochs=3", "trainer.devices=[0,3]"])
        # {'trainer': {'max_epochs': 3, 'devices': [0, 3]}}
    """
    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"override {item!r} is not key=value; write e.g. trainer.max_epochs=3")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as err:
        raise ValueError(f"cannot read overrides {' '.join(overrides)!r}: {_first_line(err)}") from err


def load(config: str | Path, overrides: Sequence[str] = ()) -> DictConfig:
    """The config at ``config`` (a path or shipped name) with ``overrides`` applied, unchecked.

    Raises:
        FileNotFoundError: no such file or shipped config.
        ValueError: the file is not a YAML mapping, or an override is malformed.

    Example::

        raw = load("digits", ["trainer.max_epochs=3"])
    """
    path = find_config(str(config))
    try:
        loaded = OmegaConf.load(path)
    except Exception as err:  # yaml.YAMLError and omegaconf errors: all mean the file is not readable YAML
        raise ValueError(f"{path} is not valid YAML: {_first_line(err)}") from err
    if not isinstance(loaded, DictConfig):
        raise ValueError(f"{path} must hold a mapping of sections (trainer:, model:, ...), not a list")
    overridden = parse_overrides([name_override(item) for item in overrides])
    align_strategy(loaded, overridden)
    merged = cast(DictConfig, OmegaConf.merge(loaded, overridden))
    name_only(merged)
    return merged


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
