"""The ``mgpu_*`` strategies. Each class registers its own names in ``register_strategies``."""

from __future__ import annotations

import importlib
from typing import Any

# module, class: one strategy per file
_STRATEGIES = (("lightning_mgpu.strategies.ddp", "MGPUDDPStrategy"),)


def strategy_classes() -> list[Any]:
    """Import and return every strategy class of the package."""
    return [getattr(importlib.import_module(module), name) for module, name in _STRATEGIES]
