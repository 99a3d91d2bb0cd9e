"""``StrategyMixin``: the one base of the mixins an ``mgpu_*`` strategy is built from.

``MicroBatching`` and ``ProcessGroupServices`` go first in a strategy's bases, before a Lightning
strategy (``class MGPUDDPStrategy(MicroBatching, ProcessGroupServices, DDPStrategy)``). A mixin takes
no ``__init__`` argument: the strategy's ``__init__`` initialises its Lightning base with Lightning's
arguments and hands each mixin its own options by name (``_init_services(stall_timeout=...)``,
``_init_micro_batching(micro_batch_size)``), so each option can be followed to what uses it. A new mixin
derives from ``StrategyMixin`` too; ``tests/strategies/auto/test_become.py`` checks that every
registered ``mgpu_*`` class can still be chosen by ``mgpu_auto``.
"""

from __future__ import annotations

from abc import ABC
from typing import TYPE_CHECKING

__all__ = ["StrategyMixin"]

if TYPE_CHECKING:
    from lightning.pytorch.strategies import ParallelStrategy

    # for the type checker a mixin is a strategy: every host is a ParallelStrategy, and what a mixin
    # needs beyond that it declares in its own class body
    StrategyMixin = ParallelStrategy
else:

    class StrategyMixin(ABC):  # noqa: B024  (no abstract method: ABC is here for the layout)
        """Base of the strategy mixins: ``abc.ABC`` like Lightning's strategies, so classes can be swapped.

        ``mgpu_auto`` is a placeholder until the Trainer hands it its devices; it then turns the very
        object the Trainer holds into the class it chose (``become``: ``obj.__class__ = chosen``).
        Python allows that only between classes of the same layout. A mixin on ``object`` placed
        first in the bases becomes the class's ``__base__`` and gives it another layout, and the
        swap fails with "object layout differs". On ``ABC``, the base of Lightning's own
        ``Strategy``, the layout stays that of every Lightning strategy.
        """
