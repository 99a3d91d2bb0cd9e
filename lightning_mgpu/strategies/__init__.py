"""The ``mgpu_*`` strategies, one room per family plus the rooms several share; each class registers itself.

Imports run one way (``tests/strategies/test_layers.py`` checks it):
``auto/`` -> the families ``ddp/``, ``fsdp/``, ``dp/`` -> ``process_group/``, ``microbatch/`` -> ``split/``;
``auto/`` -> ``process_group/`` (the process-group options it passes on) and ``resume/``;
``process_group/`` -> ``resume/``.

- ``auto/``: ``mgpu_auto`` and ``choose_strategy``: the pure decision, the facts it reads, the
  model's memory, and the class swap that turns the placeholder into its choice;
- ``ddp/``: ``mgpu_ddp`` and its unused-parameter error;
- ``fsdp/``: ``mgpu_fsdp``, FSDP2 sharding with an automatic plan;
- ``dp/``: ``mgpu_dp``, DataParallel in one process: replicas, their threads and lockstep;
- ``process_group/``: what every multi-process strategy adds to its Lightning base (checks,
  watched launcher, start-up summary, SLURM requeue, communication errors, the watchdog);
- ``resume/``: a restarted run going on where it stopped: the restart read, the newest complete
  checkpoint chosen, the training loader's place in its epoch (used by ``process_group/``);
- ``microbatch/``: the ``micro_batch_size`` mixin and its runner;
- ``split/``: cut a batch along dim 0, capture and replay ``self.log``, merge torchmetrics
  (used by ``dp/`` and ``microbatch/``);
- ``mixin.py``: ``StrategyMixin``, the one base of the mixins.
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
