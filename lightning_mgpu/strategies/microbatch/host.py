"""What micro-batching needs of the strategy it runs in: ``MicroBatchHost`` and ``CollectivePasses``.

Every ``mgpu_*`` strategy is a host (``MicroBatching`` goes first in its bases); the runner reads
nothing of it beyond these two contracts.
"""

from __future__ import annotations

from collections.abc import Hashable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule
    from lightning.pytorch.plugins.precision import Precision

    from lightning_mgpu.strategies.microbatch.agreement import Agreement

__all__ = ["CollectivePasses", "MicroBatchHost"]


class CollectivePasses(Protocol):
    """What a strategy whose passes are collectives (``mgpu_fsdp``: every unit gathers) gives micro-batching.

    Under such a strategy every rank runs the same number of micro-batches, and under ``"auto"`` a
    rank that ran out of memory runs the collectives the others are about to enter.
    """

    def watching(self, agreement: Agreement, kind: Hashable = None) -> AbstractContextManager[None]:
        """While open, each collective of a pass announced (``agreement.announce``; ``agreement.shadow``
        runs one on a rank that left its pass), or known from an earlier attempt (``agreement.leave``).
        ``kind`` names attempts whose passes run the same collectives (the stage and micro-batches)."""
        ...

    def reset(self) -> None:
        """Put the model back in a state to run a pass after one was abandoned half-way."""
        ...


class MicroBatchHost(Protocol):
    """The strategy a ``MicroBatchRunner`` runs batches for.

    Attributes:
        strategy_name: The registered name, used in messages (``"mgpu_ddp"``).
        collective_passes: ``None``, or what a strategy whose passes are collectives provides.
    """

    strategy_name: str

    @property
    def collective_passes(self) -> CollectivePasses | None: ...

    @property
    def lightning_module(self) -> LightningModule | None: ...

    @property
    def model(self) -> nn.Module | None: ...

    @property
    def root_device(self) -> torch.device: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def precision_plugin(self) -> Precision: ...

    def block_backward_sync(self) -> AbstractContextManager[None]:
        """Lightning's: DDP's gradient sync off (``DistributedDataParallel.no_sync``) while open."""
        ...

    def note_progress(self) -> None:
        """Tell whoever watches the run (the process group's watchdog) that this rank moves."""
        ...
