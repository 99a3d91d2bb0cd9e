"""Check a loaded config against the schema and report every mistake at once.

- Unknown keys: the error names the key and the closest valid one
  (``trainer.max_epoch: unknown key; did you mean trainer.max_epochs?``).
- Wrong types: omegaconf's structured configs decide, or for a key of several types (Lightning's
  ``val_check_interval``) its annotation (``config/signature.py``); the message says what was expected
  and what was given (``trainer.max_epochs: expected an integer or null, got 'ten'``).
- Impossible values: each section's ``problems()`` (``optimizer.lr: must be > 0, got -1``),
  the recipe name, and ``trainer.strategy`` with its options, checked against the strategy
  class's signature and by the strategy itself (``config/strategy.py``).

All problems are collected and raised as one ``ConfigError`` (a ``ValueError``, which the
command line prints without a traceback). Settings that are valid but do nothing in the run
(the memory monitor with ``task: predict``) get a warning instead. Everything here runs in the
launching process, before any training process starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import typing
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError

from lightning_mgpu.config.callbacks import RUN_SETS, callbacks_schema
from lightning_mgpu.config.checks import did_you_mean
from lightning_mgpu.config.optimizer import misplaced_arguments
from lightning_mgpu.config.schema import RunConfig
from lightning_mgpu.config.signature import describe
from lightning_mgpu.config.strategy import strategy_problems
from lightning_mgpu.config.trainer import RUN_OWNED, trainer_schema

__all__ = ["ConfigError", "run_schema", "validate"]

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A config that does not fit the schema; ``problems`` holds one message per mistake.

    Example::

        try:
            validate(raw, source="digits.yaml")
        except ConfigError as err:
            print(err.problems)
    """

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        noun = "problem" if len(problems) == 1 else "problems"
        super().__init__(f"{source} has {len(problems)} {noun}:\n" + "\n".join(f"  {p}" for p in problems))


def run_schema(recipe: str | None) -> type[RunConfig]:
    """The ``RunConfig`` dataclass of one recipe: ``trainer`` and ``callbacks`` read from the signatures of
    Lightning's ``Trainer`` and the callbacks, the recipe's ``ModelConfig`` and ``DataConfig`` (without a
    recipe, no ``model`` or ``data`` checks).

    Example::

        schema = run_schema("digits")
        OmegaConf.structured(schema).data.batch_size  # 64
    """
    from lightning_mgpu.recipes import load_recipe

    sections: dict[str, type] = {"trainer": trainer_schema(), "callbacks": callbacks_schema()}
    name = "AnyRunConfig"
    if recipe is not None:
        spec = load_recipe(recipe)
        sections |= {"model": spec.model_config, "data": spec.data_config}
        name = f"{spec.name.title().replace('_', '')}RunConfig"
    fields = [(key, schema, dataclasses.field(default_factory=schema)) for key, schema in sections.items()]
    return dataclasses.make_dataclass(name, fields, bases=(RunConfig,))


def validate(raw: DictConfig, source: str = "config") -> RunConfig:
    """The config as a ``RunConfig`` with the recipe's ``model`` and ``data``,; or one error for all problems.

    Raises:
        ConfigError: unknown keys (with the closest valid key), wrong types, impossible values.

    Example::

        from lightning_mgpu.config import parse

        cfg = validate(parse.load("digits", ["trainer.max_epochs=3"]), source="digits")
        cfg.trainer.max_epochs  # 3
    """
    try:
        data = cast(dict, OmegaConf.to_container(raw, resolve=True))
    except OmegaConfBaseException as err:
        raise ConfigError(source, [f"cannot resolve an interpolation: {str(err).splitlines()[0]}"]) from err

    problems: list[str] = []
    if isinstance(data.get("optimizer"), dict):
        problems += [f"optimizer.{p}" for p in misplaced_arguments(data["optimizer"])]
    schema, skip = _schema_or_problem(data.get("recipe"), problems)
    typed = OmegaConf.structured(schema)
    _merge(typed, schema, {k: v for k, v in data.items() if k not in skip}, "", _all_keys(schema), problems)
    if "recipe" in skip:
        typed.recipe = ""  # reported above; the other sections are still checked
    # A refused key keeps its (valid) default, so value checks still cover every other key.
    cfg = cast(RunConfig, OmegaConf.to_object(typed))
    problems += _value_problems(cfg, "")
    problems += strategy_problems(cfg.trainer.strategy, cfg.trainer.micro_batch_size)
    if not problems:  # cross-section checks assume each section is sound
        problems += _recipe_problems(cfg)
    if problems:
        raise ConfigError(source, problems)
    _warn_idle_callbacks(cfg)
    return cfg


def _warn_idle_callbacks(cfg: RunConfig) -> None:
    """Settings that are valid but do nothing in this run: said once, the run goes on."""
    if cfg.callbacks.memory.enabled and cfg.task != "fit":
        from lightning.pytorch.utilities import rank_zero_warn

        rank_zero_warn(
            f"callbacks.memory: the memory monitor records training only, so with task={cfg.task} it records"
            " nothing (the summary shows this process's peak instead); set callbacks.memory.enabled=false"
        )


def _schema_or_problem(recipe: Any, problems: list[str]) -> tuple[type[RunConfig], set[str]]:
    """The recipe's schema; for a missing or unknown recipe, the common schema without model/data checks."""
    from lightning_mgpu.recipes import RECIPES

    if recipe is None:
        problems.append(f"recipe: missing; set it to one of {', '.join(RECIPES)}")
    elif recipe not in RECIPES:
        suggestion = did_you_mean(str(recipe), RECIPES)
        problems.append(
            f"recipe: {recipe!r} is not a recipe; {suggestion}known recipes: {', '.join(RECIPES)}"
        )
    else:
        return run_schema(str(recipe)), set()
    return run_schema(None), {"recipe", "model", "data"}


def _merge(
    node: DictConfig, schema: type, data: dict, prefix: str, valid: list[str], problems: list[str]
) -> None:
    """Assign ``data`` into the typed ``node`` key by key, collecting a message for each refused key."""
    hints = typing.get_type_hints(schema)
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in hints:
            problems.append(_unknown_key(str(path), valid))
            continue
        section = hints[key]
        if dataclasses.is_dataclass(section):
            if not isinstance(value, dict):
                problems.append(_not_a_section(path, value))
            else:
                _merge(node[key], cast(type, section), value, f"{path}.", valid, problems)
            continue
        try:
            node[key] = _coerce(hints[key], value)
        except OmegaConfBaseException:
            problems.append(f"{path}: expected {describe(hints[key])}, got {value!r}")


def _coerce(hint: Any, value: Any) -> Any:
    """The conversions YAML makes necessary: ``1`` for a float field, ``16`` for a string field; ``true``
    for a string field is refused (omegaconf would store it as ``'True'``)."""
    types = (hint, *typing.get_args(hint))
    if str in types and type(value) is bool:
        raise ValidationError(f"a string, got {value!r}")
    if float in types and type(value) is int:
        return float(value)
    if str in types and type(value) in (int, float):
        return str(value)
    return value


def _not_a_section(path: str, value: Any) -> str:
    fix = (
        f"; to turn it off write {path}.enabled=false" if path.startswith("callbacks.") and not value else ""
    )
    return f"{path}: expected a section of keys, got {value!r}{fix}"


def _all_keys(schema: type, prefix: str = "") -> list[str]:
    keys = []
    for name, hint in typing.get_type_hints(schema).items():
        keys.append(f"{prefix}{name}")
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            keys += _all_keys(hint, f"{prefix}{name}.")
    return keys


def _unknown_key(path: str, valid: list[str]) -> str:
    """The message for an unknown key: the closest key of its section, else that name in another section."""
    parent, _, leaf = path.rpartition(".")
    owned = RUN_OWNED if parent == "trainer" else RUN_SETS if parent.startswith("callbacks.") else {}
    if leaf in owned:
        return f"{path}: set by the run; {owned[leaf]}"
    siblings = {k.rpartition(".")[2]: k for k in valid if k.rpartition(".")[0] == parent}
    leaves = {k.rpartition(".")[2]: k for k in reversed(valid)}  # first key of each name wins
    if leaf in leaves:  # the exact name in another section: trainer.batch_size -> data.batch_size
        close = [leaves[leaf]]
    else:
        close = [siblings[name] for name in difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.6)]
    if not close:  # e.g. trainer.lr -> optimizer.lr
        close = [leaves[name] for name in difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.8)]
    if close:
        return f"{path}: unknown key; did you mean {close[0]}?"
    where = f"in {parent}" if parent else "at the top level"
    return f"{path}: unknown key; valid keys {where}: {', '.join(siblings)}"


def _value_problems(obj: Any, prefix: str) -> list[str]:
    """Every dataclass section's ``problems()``, prefixed with its path."""
    out = [f"{prefix}{p}" for p in obj.problems()] if hasattr(obj, "problems") else []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out += _value_problems(value, f"{prefix}{f.name}.")
    return out


def _recipe_problems(cfg: RunConfig) -> list[str]:
    from lightning_mgpu.recipes import load_recipe

    spec = load_recipe(cfg.recipe)
    if cfg.task not in spec.tasks:
        return [f"task: recipe {spec.name} cannot {cfg.task}; it supports {', '.join(spec.tasks)}"]
    return list(spec.check(cfg))
