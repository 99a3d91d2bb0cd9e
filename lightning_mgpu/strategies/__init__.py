"""The ``mgpu_*`` strategies, one folder per family; each class registers its names itself.

- ``auto.py``: ``mgpu_auto`` and ``choose_strategy``, which pick one of the others and say why, from
  ``auto_facts.py`` (what they read of the environment) and ``model_memory.py`` (what the model needs);
  ``auto_model.py`` turns ``mgpu_auto`` into its choice, and into ``mgpu_fsdp`` once the model is known;
- ``ddp/``: ``mgpu_ddp``, and the process-group services every multi-process strategy shares
  (``ProcessGroupServices``: checks, watched launcher, start-up summary, watchdog);
- ``dp/``: ``mgpu_dp``, DataParallel in one process: replicas, scatter/gather, log and metric merging;
- ``fsdp/``: ``mgpu_fsdp``, FSDP2 sharding with an automatic plan, on ``ddp/``'s process-group services.
"""

from __future__ import annotations

import importlib
from typing import Any

# package or module, class
_STRATEGIES = (
    ("lightning_mgpu.strategies.ddp", "MGPUDDPStrategy"),
    ("lightning_mgpu.strategies.dp", "MGPUDataParallelStrategy"),
    ("lightning_mgpu.strategies.fsdp", "MGPUFSDPStrategy"),
    ("lightning_mgpu.strategies.auto", "MGPUAutoStrategy"),
)


def strategy_classes() -> list[Any]:
    """Import and return every strategy class of the package."""
    return [getattr(importlib.import_module(module), name) for module, name in _STRATEGIES]


# A strategy module imports Lightning, and Lightning's import registers every strategy
# (see ``_registration``). Importing Lightning here, before any strategy module starts,
# means that registration never meets a strategy module that is only half imported.
import lightning.pytorch  # noqa: E402, F401
