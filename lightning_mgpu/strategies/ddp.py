"""``mgpu_ddp``: Lightning's DDP with the defaults and safety nets that multi-GPU users expect."""

from __future__ import annotations

from typing import Any

from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override


class MGPUDDPStrategy(DDPStrategy):
    """Distributed data parallel training, one process per device, on one or several machines.

    Takes every argument of Lightning's ``DDPStrategy``.

    Example::

        import lightning as L
        import lightning_mgpu

        trainer = L.Trainer(accelerator="gpu", devices=[0, 3], strategy="mgpu_ddp")
    """

    strategy_name = "mgpu_ddp"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="DDP that keeps the user's shuffle, names dead or stalled ranks and never hangs",
            override=True,
        )
