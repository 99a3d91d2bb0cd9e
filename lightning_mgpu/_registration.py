"""Register the strategies in Lightning's ``StrategyRegistry`` without importing Lightning early.

``import lightning_mgpu`` must register ``mgpu_*`` strategy names, but importing
Lightning (and torch) at that point would cost seconds for users who only want
the command line or a checkpoint helper. So:

- if ``lightning.pytorch`` is already imported, register now;
- otherwise add a finder to ``sys.meta_path`` that registers right after
  ``lightning.pytorch`` finishes importing, whoever imports it.

Registration uses ``override=True``, so importing or reloading twice is harmless.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any

_TARGET = "lightning.pytorch"


def register_strategies() -> None:
    """Add every ``mgpu_*`` strategy to ``lightning.pytorch.strategies.StrategyRegistry``."""
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_mgpu.strategies import strategy_classes

    for cls in strategy_classes():
        cls.register_strategies(StrategyRegistry)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds ``lightning.pytorch`` through the other finders and registers once it has executed."""

    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TARGET:
            return None
        _remove_finder()
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original_exec(module)
            register_strategies()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _remove_finder() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != _RegisterAfterImport.__name__]


def register_when_lightning_loads() -> None:
    """Register now if Lightning is loaded, else as soon as it is."""
    if _TARGET in sys.modules:
        register_strategies()
        return
    _remove_finder()  # a reload must not stack finders
    sys.meta_path.insert(0, _RegisterAfterImport())
