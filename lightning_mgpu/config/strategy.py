"""``trainer.strategy``: a registered name, or a mapping of that name and options of the strategy's class.

A name alone (``strategy: mgpu_ddp``) gives the Trainer the registered strategy with its defaults. A
mapping adds any keyword the strategy class's ``__init__`` takes, as ``MGPUDDPStrategy(...)`` would::

    trainer:
      strategy:
        name: mgpu_ddp
        stall_timeout: 60       # seconds without a step before a stalled rank is named
        micro_batch_size: auto  # halve a batch that runs out of memory

    lightning-mgpu run digits trainer.strategy.name=mgpu_ddp trainer.strategy.stall_timeout=60

- ``strategy_problems`` checks the options against ``inspect.signature`` of the strategy class: an
  unknown key gets "did you mean" (or the strategies that take it), a value its annotation refuses is
  named; then the strategy is built once, so its own checks of the values speak
  (``check_micro_batch_size``, the stall timeout's, ...). ``trainer.micro_batch_size``, the short form
  of ``trainer.strategy.micro_batch_size``, goes through the same ``check_micro_batch_size``.
- A ``timedelta`` option (``timeout``) takes seconds. Keywords ``mgpu_ddp`` (like Lightning's ``ddp``)
  passes on to ``DistributedDataParallel`` are options too (``find_unused_parameters``, ...).
- ``build_strategy`` makes what the Trainer's ``strategy=`` receives; ``align_strategy`` and
  ``name_override`` let an override such as ``trainer.strategy.stall_timeout=60`` merge into a config
  that names the strategy alone, and ``name_only`` writes ``{name: NAME}`` back as ``NAME``.

Importing this module does not import torch; checking or building a strategy does.
"""

from __future__ import annotations

import inspect
import logging
import typing
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_mgpu.config.checks import did_you_mean
from lightning_mgpu.config.signature import checked, convert, keywords, not_taken, wrong_type

if typing.TYPE_CHECKING:
    from lightning.pytorch.strategies import Strategy

__all__ = ["align_strategy", "build_strategy", "name_only", "name_override", "strategy_problems"]

log = logging.getLogger(__name__)

_SHORT_FORM = "trainer.micro_batch_size"  # the one strategy option with a key in the trainer section

# Lightning 1.x names that Lightning 2 removed, and what to use instead
_LIGHTNING_1X_STRATEGIES = {
    "dp": "mgpu_dp (DataParallel in one process) or mgpu_ddp (one process per device)",
    **dict.fromkeys(
        ("ddp2", "ddp_cpu", "ddp_sharded", "ddp_sharded_spawn", "ddp_spawn_sharded", "horovod", "bagua"),
        "mgpu_ddp (one process per device) or mgpu_dp (DataParallel in one process)",
    ),
}


def align_strategy(file: DictConfig, overrides: DictConfig) -> None:
    """Ready the file's ``trainer.strategy`` to merge with the overrides' (``name_override`` readied theirs).

    - ``strategy: NAME`` becomes ``{name: NAME}``, so ``trainer.strategy.stall_timeout=60`` keeps NAME;
    - overrides naming another strategy drop the file's options: they were for the file's strategy.
    """
    trainer = file.get("trainer")
    if not isinstance(trainer, DictConfig):
        return
    if isinstance(trainer.get("strategy"), str):
        trainer.strategy = {"name": trainer.strategy}
    new = OmegaConf.select(overrides, "trainer.strategy.name", default=None)
    old = OmegaConf.select(file, "trainer.strategy.name", default=None)
    if new is not None and new != old:
        trainer.strategy = {"name": new}


def name_override(item: str) -> str:
    """``trainer.strategy=NAME`` as ``trainer.strategy.name=NAME``, so an option given after it keeps NAME."""
    key, _, value = item.partition("=")
    if key.strip() == "trainer.strategy" and not value.lstrip().startswith("{"):
        return f"trainer.strategy.name={value}"
    return item


def name_only(merged: DictConfig) -> None:
    """Write ``trainer.strategy: {name: NAME}`` back as ``NAME``: how the config said it."""
    trainer = merged.get("trainer")
    strategy = trainer.get("strategy") if isinstance(trainer, DictConfig) else None
    if isinstance(strategy, DictConfig) and list(strategy) == ["name"]:
        trainer.strategy = strategy.name


def strategy_problems(value: Any, micro_batch_size: Any) -> list[str]:
    """What is wrong with ``trainer.strategy`` and ``trainer.micro_batch_size``, one message each.

    Example::

        strategy_problems({"name": "mgpu_ddp", "stall_timout": 60}, None)
        # ['trainer.strategy.stall_timout: mgpu_ddp takes no option stall_timout; did you mean ...']
    """
    from lightning_mgpu.strategies.microbatch.mixin import check_micro_batch_size

    out = checked("trainer", ["micro_batch_size"], lambda: check_micro_batch_size(micro_batch_size))
    named = isinstance(value, str) or (isinstance(value, dict) and isinstance(value.get("name"), str))
    if not named:
        return [
            *out,
            "trainer.strategy: expected a strategy name such as mgpu_ddp, or a mapping of name: and the"
            f" strategy's options such as {{name: mgpu_ddp, stall_timeout: 60}}, got {value!r}",
        ]
    name, options = _split(value)
    if problem := _name_problem(name):
        return [*out, problem]
    paths = {key: f"trainer.strategy.{key}" for key in options}
    if micro_batch_size is not None and not out:
        if "micro_batch_size" in options:
            return [f"{_SHORT_FORM}: trainer.strategy.micro_batch_size is set too; keep one"]
        options["micro_batch_size"], paths["micro_batch_size"] = micro_batch_size, _SHORT_FORM
    cls = _registered(name).get("strategy")
    params = _options(cls) if cls is not None else {}
    for key, given in options.items():
        if key not in params:
            out.append(_not_taken(paths[key], name, key, list(params)))
        else:
            out += wrong_type(paths[key], given, params[key])
    if not out and cls is not None and options:  # the strategy's own checks of the values
        out += checked("trainer.strategy", options, lambda: build_strategy(value, micro_batch_size))
    return out


def build_strategy(value: str | dict[str, Any], micro_batch_size: int | str | None = None) -> str | Strategy:
    """What the Trainer's ``strategy=`` gets: the name alone, or with options the strategy built with them.

    Example::

        build_strategy({"name": "mgpu_ddp", "stall_timeout": 60})  # MGPUDDPStrategy(stall_timeout=60)
    """
    name, options = _split(value)
    if micro_batch_size is not None:
        options["micro_batch_size"] = micro_batch_size
    if not options:
        return name
    if not (registered := _registered(name)):
        raise ValueError(f"trainer.strategy: {name!r} takes no options; name a strategy such as mgpu_ddp")
    log.debug("trainer.strategy %s with %s", name, options)
    params = _options(registered["strategy"])
    kwargs = {k: convert(v, params[k]) for k, v in options.items()}
    strategy: Strategy = registered["strategy"](**registered["init_params"], **kwargs)
    return strategy


def _split(value: str | dict[str, Any]) -> tuple[str, dict[str, Any]]:
    if isinstance(value, str):
        return value, {}
    options = dict(value)
    return options.pop("name"), options


def _registered(name: str) -> dict[str, Any]:
    """The registry's entry for ``name``: its ``strategy`` class and the ``init_params`` its registration
    adds; ``{}`` for a name that is not registered (``auto``)."""
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_mgpu  # noqa: F401  registers the mgpu_* names

    if name not in StrategyRegistry:  # not StrategyRegistry.get: that builds the strategy
        return {}
    return StrategyRegistry[name]


def _name_problem(name: str) -> str | None:
    from lightning.pytorch.strategies import StrategyRegistry

    names = ["auto", *StrategyRegistry.available_strategies()]
    if name in names:
        return None
    if name in _LIGHTNING_1X_STRATEGIES:
        log.debug("trainer.strategy %r: a Lightning 1.x name, not a near miss of a 2.x one", name)
        return (
            f"trainer.strategy: {name!r} is a Lightning 1.x strategy that Lightning 2 removed;"
            f" use {_LIGHTNING_1X_STRATEGIES[name]}"
        )
    mgpu = ", ".join(n for n in names if n.startswith("mgpu_"))
    return f"trainer.strategy: {name!r} is not a registered strategy; {did_you_mean(name, names)}e.g. {mgpu}"


def _options(cls: type) -> dict[str, Any]:
    """Each keyword of ``cls.__init__`` and its annotation (a string where it names a type-checker import)."""
    from lightning.pytorch.strategies import DDPStrategy
    from torch.nn.parallel import DistributedDataParallel

    params = keywords(cls)
    out = {name: p.annotation for name, p in params.items()}
    if issubclass(cls, DDPStrategy) and any(
        p.kind is p.VAR_KEYWORD for p in inspect.signature(cls).parameters.values()
    ):
        # DDPStrategy passes its other keywords to DistributedDataParallel, which takes these
        wrapped = keywords(DistributedDataParallel)
        out.update({n: p.annotation for n, p in wrapped.items() if n not in ("module", "device_ids", *out)})
    return out


def _not_taken(path: str, name: str, key: str, params: list[str]) -> str:
    """An option ``name`` does not take: the strategies that take it, else the closest option of ``name``."""
    from lightning.pytorch.strategies import StrategyRegistry

    takers = [  # the names without preset arguments (ddp, not ddp_find_unused_parameters_true)
        n
        for n in StrategyRegistry.available_strategies()
        if not StrategyRegistry[n]["init_params"] and key in _options(StrategyRegistry[n]["strategy"])
    ]
    if takers:
        log.debug("trainer.strategy %r does not take %s; these do: %s", name, key, takers)
        fix = f"set {path}=null" if path == _SHORT_FORM else f"remove {path}"
        return (
            f"{path}: strategy {name!r} does not take {key}; the strategies that take {key} are"
            f" {', '.join(takers)} (set trainer.strategy to one of them), or {fix}"
        )
    return not_taken(path, name, "option", params)
