"""``mgpu_auto``: picks ``mgpu_ddp``, ``mgpu_fsdp``, ``mgpu_dp`` or one device for the code and the model.

- ``decide.py``: the pure decision (``decide``, ``StrategyChoice``, ``with_micro_batching``):
  plain facts in (``EnvironmentFacts``, what it reads of the environment), a choice with its reason out;
- ``model_memory.py``: ``ModelMemory``, what the model needs of one device, whole and sharded;
- ``become.py``: the class swap, in one place: the placeholder becomes the chosen strategy, and
  ``PendingDDPStrategy`` becomes ``mgpu_fsdp`` once the model shows it needs sharding;
- ``strategy.py``: ``MGPUAutoStrategy`` (registered as ``mgpu_auto``) and ``choose_strategy``.
"""

from lightning_mgpu.strategies.auto.decide import StrategyChoice
from lightning_mgpu.strategies.auto.strategy import MGPUAutoStrategy, choose_strategy

__all__ = ["MGPUAutoStrategy", "StrategyChoice", "choose_strategy"]
