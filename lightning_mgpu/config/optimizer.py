"""The ``optimizer`` section: which class, its arguments and the schedule; and building the optimizer.

- ``_component_`` names the class as a dotted path, as torchtune's configs do: ``torch.optim.AdamW``,
  ``torch.optim.RMSprop`` or a class of your own package. The short names ``adamw``, ``adam`` and
  ``sgd`` stand for torch's classes.
- ``lr``, ``weight_decay`` and ``momentum`` go to the class where its signature takes them;
  ``kwargs`` holds any other argument (``optimizer.kwargs.betas=[0.9,0.95]``).
- ``_component_problems`` imports the class during validation and checks the arguments, so a
  typo in a class path or argument name is reported, with a suggestion, before anything runs;
  ``misplaced_arguments`` points an argument written beside the section's keys (``optimizer.betas``,
  as torchtune lays it out) to ``optimizer.kwargs.betas``.
- ``build_optimizer`` fills in the schema's defaults and makes the optimizer.

Importing this module does not import torch; checking or building the class does.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from lightning_mgpu.config.checks import at_least, did_you_mean, one_of
from lightning_mgpu.config.signature import keywords, not_taken

if TYPE_CHECKING:
    import torch

__all__ = ["OptimizerConfig", "build_optimizer", "misplaced_arguments", "with_defaults"]

log = logging.getLogger(__name__)

_SHORT_NAMES = {"adamw": "torch.optim.AdamW", "adam": "torch.optim.Adam", "sgd": "torch.optim.SGD"}
"""Short names a config may give for ``_component_``, and the class each stands for."""

_SCHEDULERS = ("none", "cosine")
_SECTION_ARGS = ("lr", "weight_decay", "momentum")


@dataclass
class OptimizerConfig:
    """The optimizer and learning-rate schedule.

    Example::

        lightning-mgpu run digits optimizer._component_=torch.optim.RMSprop optimizer.lr=0.01
        lightning-mgpu run digits optimizer._component_=sgd optimizer.lr=0.1 optimizer.scheduler=none
    """

    _component_: str = "torch.optim.AdamW"
    """The optimizer class as a dotted path (``torch.optim.AdamW``, ``my_package.optim.Lion``), or a short
    name: ``adamw``, ``adam``, ``sgd``."""
    lr: float = 1e-3
    """Learning rate."""
    weight_decay: float = 0.0
    """Weight decay (decoupled for ``AdamW``), for classes that take it."""
    momentum: float = 0.9
    """Momentum, for classes that take it (``SGD``, ``RMSprop``); ignored by Adam and AdamW."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Further arguments of the class, e.g. ``{betas: [0.9, 0.95]}``; checked against its signature."""
    scheduler: str = "none"
    """``none``, or ``cosine``: decay the learning rate to 0 over the run's optimizer steps (so the run
    needs ``trainer.max_steps`` or ``trainer.max_epochs``)."""

    def problems(self) -> list[str]:
        """Impossible values in this section, one message each (imports the optimizer class)."""
        out = one_of("scheduler", self.scheduler, _SCHEDULERS)
        if self.lr <= 0:
            out.append(f"lr: must be > 0, got {self.lr:g}")
        out += at_least("weight_decay", self.weight_decay, 0.0)
        if not 0.0 <= self.momentum < 1.0:
            out.append(f"momentum: must be in [0, 1), got {self.momentum:g}")
        return out + _component_problems(self._component_, self.kwargs)


def _optimizer_class(component: str) -> type[torch.optim.Optimizer]:
    """The class ``component`` names: a short name (``adamw``) or a dotted path (``torch.optim.AdamW``).

    Raises:
        ValueError: the path does not import, names no class, or a class that is not an optimizer;
            the message says which part is wrong and suggests the closest name.

    Example::

        _optimizer_class("sgd")  # torch.optim.SGD
    """
    import torch

    path = _SHORT_NAMES.get(component, component)
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        hint = did_you_mean(component, _SHORT_NAMES, "did you mean {}? Otherwise ")
        raise ValueError(
            f"{component!r} is not an optimizer; {hint}give a short name ({', '.join(_SHORT_NAMES)})"
            " or a class path such as torch.optim.AdamW"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{path!r}: cannot import {module_name} ({err})") from err
    cls = getattr(module, attr, None)
    if cls is None:
        classes = [n for n, v in vars(module).items() if isinstance(v, type) and not n.startswith("_")]
        hint = did_you_mean(attr, classes, f"; did you mean {module_name}.{{}}?")
        raise ValueError(f"{path!r}: {module_name} has no {attr}{hint}")
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"{path!r} is not a torch.optim.Optimizer class, got {cls!r}")
    return cls


def _component_problems(component: str, kwargs: Mapping[str, Any]) -> list[str]:
    """Messages for a class that does not import, or ``kwargs`` its signature does not take.

    Example::

        _component_problems("torch.optim.AdamW", {"betaz": [0.9, 0.95]})
        # ['kwargs.betaz: torch.optim.AdamW takes no argument betaz; did you mean betas?']
    """
    try:
        cls = _optimizer_class(component)
    except ValueError as err:
        return [f"_component_: {err}"]
    takes = _arguments(cls)
    out = []
    for key in kwargs:
        if key in _SECTION_ARGS:
            out.append(f"kwargs.{key}: set it as optimizer.{key}, the section's own key")
        elif key not in takes:
            out.append(not_taken(f"kwargs.{key}", _SHORT_NAMES.get(component, component), "argument", takes))
    return out


def misplaced_arguments(section: MutableMapping[str, Any]) -> list[str]:
    """Class arguments written beside the section's keys (torchtune's layout): removed, one message each.

    Example::

        section = {"_component_": "torch.optim.AdamW", "betas": [0.9, 0.95]}
        misplaced_arguments(section)
        # ['betas: an argument of torch.optim.AdamW; write it under kwargs: optimizer.kwargs.betas']
    """
    component = section.get("_component_", OptimizerConfig._component_)
    own = {f.name for f in fields(OptimizerConfig)}
    try:
        takes = _arguments(_optimizer_class(str(component)))
    except ValueError:
        return []  # the class itself is reported
    out = []
    for key in [k for k in section if k not in own and k in takes]:
        del section[key]
        path = _SHORT_NAMES.get(str(component), str(component))
        out.append(f"{key}: an argument of {path}; write it under kwargs: optimizer.kwargs.{key}")
    return out


def with_defaults(section: Mapping[str, Any] | None) -> dict[str, Any]:
    """``section`` (a config's ``optimizer``, or a dict like ``{"_component_": "sgd"}``) over the defaults.

    Raises:
        ValueError: the section has a key the schema does not (``name``: write ``_component_``).

    Example::

        with_defaults({"_component_": "sgd"})["lr"]  # 0.001
    """
    defaults, given = asdict(OptimizerConfig()), dict(section or {})
    if unknown := [k for k in given if k not in defaults]:
        raise ValueError(f"optimizer: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(defaults)}")
    return {**defaults, **given}


def build_optimizer(params: Iterable[Any], section: Mapping[str, Any] | None) -> torch.optim.Optimizer:
    """The optimizer ``section`` describes, over ``params``.

    ``lr``, ``weight_decay`` and ``momentum`` are passed where the class takes them, then ``kwargs``.

    Raises:
        ValueError: the class cannot be found (see ``_optimizer_class``).

    Example::

        opt = build_optimizer(model.parameters(), {"_component_": "sgd", "lr": 0.1})
    """
    cfg = with_defaults(section)
    cls = _optimizer_class(cfg["_component_"])
    takes = _arguments(cls)
    kwargs = {k: cfg[k] for k in _SECTION_ARGS if k in takes}
    kwargs.update(cfg["kwargs"])
    left_out = [k for k in _SECTION_ARGS if k not in takes] or "nothing"
    used = f"{cls.__module__}.{cls.__qualname__} for {cfg['_component_']!r} with {kwargs}"
    log.debug("optimizer %s (left out, not in its signature: %s)", used, left_out)
    return cls(params, **kwargs)


def _arguments(cls: type) -> list[str]:
    return [n for n in keywords(cls) if n != "params"]
