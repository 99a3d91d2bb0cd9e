"""How ``mgpu_auto`` becomes the strategy it chose, and its second look once the model is known.

- ``become``: turns the strategy object the Trainer holds into the chosen class, initialised
  again on that object, with the accelerator, precision, checkpoint_io, cluster environment,
  devices and node count the Trainer gave it;
- ``PendingDDPStrategy``: ``mgpu_ddp`` until the Trainer connects the model; then, if a whole
  copy of its parameters, gradients and optimizer state does not fit a device but their shards do,
  it becomes
  ``mgpu_fsdp`` on the processes already started (both launch the same way, see
  ``process_group/services.py``); if even the shards do not fit, it refuses with the numbers.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.strategies import ParallelStrategy, SingleDeviceStrategy, Strategy, StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_mgpu._compat.lightning import (
    Launcher,
    configure_launcher,
    set_launcher,
    set_layer_sync,
    strategy_parts,
)
from lightning_mgpu._compat.lightning import launcher as launcher_of
from lightning_mgpu.callbacks.time import DeviceTimeMonitor
from lightning_mgpu.precision import FSDP_PRECISIONS
from lightning_mgpu.strategies.auto.decide import StrategyChoice, with_micro_batching, with_options
from lightning_mgpu.strategies.auto.model_memory import (
    ModelMemory,
    model_memory,
    sharding_reason,
    shortfall_reason,
)
from lightning_mgpu.strategies.ddp.strategy import MGPUDDPStrategy
from lightning_mgpu.strategies.microbatch.mixin import MicroBatching

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["TIMED", "PendingChoice", "PendingDDPStrategy", "become"]

log = logging.getLogger(__name__)


def become(
    strategy: Strategy,
    choice: StrategyChoice,
    devices: list[torch.device],
    strategy_class: type[Strategy] | None = None,
    launcher: Launcher | None = None,
) -> None:
    """Turn ``strategy`` into ``choice``'s strategy on ``devices``, keeping the Trainer's settings.

    The object is initialised again as the chosen class (``__class__`` and ``__init__``), so
    what the new class builds around itself (a micro-batch runner, say) refers to the object
    the Trainer holds. The accelerator, precision plugin, checkpoint_io, cluster environment,
    layer sync and ``num_nodes`` it had are kept; ``choice`` is kept as ``strategy.choice``.

    Args:
        strategy: The strategy the Trainer configured (the ``mgpu_auto`` placeholder, or the
            ``mgpu_ddp`` it became).
        choice: The decision; its ``options`` are passed to the new class.
        devices: The devices of this node.
        strategy_class: This class instead of the registered one (with the registered arguments).
        launcher: A launcher that already started the processes: kept. ``None`` configures
            the new strategy's own.

    Raises:
        ValueError: ``micro_batch_size`` for a strategy that cannot micro-batch.
    """
    kwargs: dict[str, Any]
    if choice.strategy == "single_device":
        cls: type[Strategy] = SingleDeviceStrategy
        kwargs = {"device": devices[0] if devices else "cpu"}
    else:
        entry = StrategyRegistry[choice.strategy]
        cls = strategy_class or entry["strategy"]
        kwargs = {**entry["init_params"], **choice.options}
    if "micro_batch_size" in kwargs and not issubclass(cls, MicroBatching):
        raise ValueError(
            f"mgpu_auto chose {choice.strategy} ({choice.reason}), which cannot run micro-batches:"
            " remove micro_batch_size from MGPUAutoStrategy(...), or name a strategy yourself"
        )
    accelerator, precision, checkpoint_io, layer_sync = strategy_parts(strategy)
    cluster_environment = getattr(strategy, "cluster_environment", None)
    num_nodes = getattr(strategy, "num_nodes", 1)

    strategy.__dict__.clear()
    strategy.__class__ = cls
    cls.__init__(strategy, **kwargs)
    if accelerator is not None:
        strategy.accelerator = accelerator
    if precision is not None:
        strategy.precision_plugin = precision
    if checkpoint_io is not None:
        strategy.checkpoint_io = checkpoint_io
    if isinstance(strategy, ParallelStrategy):
        if strategy.cluster_environment is None:
            strategy.cluster_environment = cluster_environment
        strategy.parallel_devices = devices
        set_layer_sync(strategy, layer_sync)
    if hasattr(strategy, "num_nodes"):
        strategy.num_nodes = num_nodes
    if hasattr(strategy, "set_world_ranks"):
        strategy.set_world_ranks()
    if launcher is None:
        configure_launcher(strategy)
    else:
        set_launcher(strategy, launcher)
    strategy.choice = choice  # type: ignore[attr-defined]
    if choice.strategy in TIMED:
        # an instance attribute: the Trainer calls it, and a second become() (mgpu_ddp turned
        # mgpu_fsdp) clears it with the rest of __dict__ and sets it again
        strategy.connect = functools.partial(_connect_timed, strategy)  # type: ignore[method-assign]


TIMED = ("mgpu_ddp", "mgpu_fsdp", "ddp_notebook")
"""The choices that run one process per device, where ``DeviceTimeMonitor`` names a slow rank."""


def _connect_timed(strategy: Strategy, model: pl.LightningModule) -> None:
    """The chosen class's ``connect``, then a ``DeviceTimeMonitor`` unless the Trainer has one.

    At its measured cost (benchmarks/memory_overhead.py: 0.07-0.26 % of a step, 2 processes), a run
    that ``mgpu_auto`` spreads over processes says at its end which rank is slow and why. It writes no
    file (``summary_file=None``); a monitor of the user's own, with any settings, takes its place.
    """
    type(strategy).connect(strategy, model)  # the class of the moment: PendingDDPStrategy may change it
    try:
        trainer = model.trainer
    except RuntimeError:  # connected outside a Trainer's run: no callbacks to add to
        return
    callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by its callback connector
    if not any(isinstance(callback, DeviceTimeMonitor) for callback in callbacks):
        callbacks.append(DeviceTimeMonitor(summary_file=None))
        log.debug("mgpu_auto added DeviceTimeMonitor(summary_file=None) to the Trainer's callbacks")


@dataclass(frozen=True)
class PendingChoice:
    """What ``PendingDDPStrategy`` needs to decide again once the model is known."""

    redecide: Callable[[ModelMemory], StrategyChoice]
    """``decide`` with the facts, devices and nodes of the first decision, given the model's memory."""
    device_memory: int
    world: int
    micro_batch_size: int | str | None
    passed_on: dict[str, Any] = field(default_factory=dict)
    """What ``mgpu_auto`` passes on (resumption, process group), for ``mgpu_fsdp`` as for ``mgpu_ddp``."""


class PendingDDPStrategy(MGPUDDPStrategy):
    """``mgpu_ddp`` that ``mgpu_auto`` may still turn into ``mgpu_fsdp`` when the Trainer connects the model.

    ``mgpu_auto`` builds it (``pending``) when it picks ``mgpu_ddp`` and knows the device memory.
    ``connect`` runs in every process, after they were started and before the process group
    exists; each process measures the same model against the same memory, so all decide alike:

    - a whole copy of the parameters, gradients and optimizer state (the state one step of
      ``configure_optimizers()``'s optimizer creates, in the Trainer's precision) fits a device:
      it stays ``mgpu_ddp``;
    - only their shards (with the largest unit gathered) fit: ``mgpu_fsdp``, logged with the
      numbers, unless the Trainer's precision is one ``mgpu_fsdp`` refuses (a warning says so);
    - neither fits: ``ValueError`` with the numbers and how many devices would do.

    Either way the object is then an ordinary ``MGPUDDPStrategy`` or ``MGPUFSDPStrategy``.
    """

    pending: PendingChoice | None = None

    @override
    def connect(self, model: pl.LightningModule) -> None:
        pending = self.__dict__.pop("pending", None)
        self.__class__ = MGPUDDPStrategy  # type: ignore[assignment]  # decided once
        if pending is not None:
            _second_look(self, model, pending)
        self.connect(model)  # the connect of the class decided on


def _second_look(strategy: MGPUDDPStrategy, model: pl.LightningModule, pending: PendingChoice) -> None:
    """Turn ``strategy`` into ``mgpu_fsdp`` when only the model's shards fit a device (see the class)."""
    precision = getattr(strategy.precision_plugin, "precision", "32-true")
    memory = model_memory(model, pending.world, pending.device_memory, precision)
    log.debug("model memory under precision=%s: %s", precision, memory)
    if memory.fits_nowhere:
        raise ValueError(f"mgpu_auto: {shortfall_reason(memory)}")
    if not memory.needs_sharding:
        log.debug("mgpu_auto keeps mgpu_ddp: a whole copy of the model state fits one device")
        return
    if precision not in FSDP_PRECISIONS:
        rank_zero_warn(
            f"mgpu_auto keeps mgpu_ddp although {sharding_reason(memory)}: mgpu_fsdp does not support"
            f" precision={precision!r}. Choose one of {', '.join(FSDP_PRECISIONS)} to have the model sharded."
        )
        return
    choice = with_micro_batching(pending.redecide(memory), pending.micro_batch_size)
    choice = with_options(choice, pending.passed_on)
    if choice.strategy != "mgpu_fsdp":  # the same facts as the first decision: not expected
        log.debug("mgpu_auto keeps mgpu_ddp: %s", choice)
        return
    rank_zero_info(f"mgpu_auto chose {choice.strategy}: {choice.reason}")
    become(strategy, choice, list(strategy.parallel_devices or []), launcher=launcher_of(strategy))
