"""``mgpu_auto`` and ``choose_strategy``: the decision of ``decide.py`` applied where the code runs.

The ``mgpu_auto`` strategy applies the decision inside the Trainer. A registered strategy
is built before the Trainer has resolved ``devices`` and ``num_nodes``, so ``mgpu_auto``
starts as a placeholder: the Trainer hands it the accelerator, precision, devices, node
count and cluster environment, and then calls ``_configure_launcher`` on it. There it
decides, builds the chosen strategy with exactly those settings, and takes its place
(the object becomes an instance of the chosen class), so ``trainer.strategy`` is an
ordinary ``MGPUDDPStrategy``, ``DDPStrategy``, ``SingleDeviceStrategy`` or
``MGPUDataParallelStrategy``. The decision is logged once, with its reason.

The model is not known there. When the choice is ``mgpu_ddp`` and the device memory is
known, the log says so and ``mgpu_auto`` decides again when the Trainer connects the model,
in every process (``become.PendingDDPStrategy``): ``mgpu_fsdp`` by ``decide``'s memory rule (the
parameters, gradients and the state of the model's optimizer, in the Trainer's precision), logged
with the numbers (``mgpu_ddp`` stays, with a warning, under a precision ``mgpu_fsdp``
refuses), and a ``ValueError`` with the numbers when even the shards do not fit, before
anything is moved. ``micro_batch_size=`` is passed on to the chosen strategy; one device
and ``ddp_notebook``, which cannot micro-batch, give way to ``mgpu_dp``. A choice of one process per
device (``become.TIMED``) adds a ``DeviceTimeMonitor`` to the Trainer's callbacks when it has none.
"""

from __future__ import annotations

import functools
import logging
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.accelerators import Accelerator, AcceleratorRegistry
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_mgpu._compat.lightning import StrategyRegistry
from lightning_mgpu.devices import format_bytes, parse_bytes
from lightning_mgpu.estimate.predict import device_memory_of
from lightning_mgpu.strategies.auto.become import PendingChoice, PendingDDPStrategy, become
from lightning_mgpu.strategies.auto.decide import (
    EnvironmentFacts,
    StrategyChoice,
    decide,
    left_out,
    with_micro_batching,
    with_options,
)
from lightning_mgpu.strategies.auto.model_memory import model_memory
from lightning_mgpu.strategies.microbatch.mixin import check_micro_batch_size
from lightning_mgpu.strategies.process_group.services import STALL_TIMEOUT
from lightning_mgpu.strategies.resume.resumption import DEFAULTS, check_options

__all__ = ["MGPUAutoStrategy", "choose_strategy"]

log = logging.getLogger(__name__)


def _accelerator_name(accelerator_cls: type[Accelerator]) -> str:
    """The accelerator's registered name ("cpu", "cuda", ...); ``Accelerator.name()`` is in Lightning 2.6+."""
    if hasattr(accelerator_cls, "name"):
        return str(accelerator_cls.name())
    for name in AcceleratorRegistry.available_accelerators():
        if AcceleratorRegistry[name]["accelerator"] is accelerator_cls:
            return name
    return accelerator_cls.__name__


def _resolve_devices(
    devices: int | str | list[int], accelerator: str | Accelerator, facts: EnvironmentFacts
) -> tuple[int, str]:
    if isinstance(accelerator, Accelerator):
        accelerator_cls: type[Accelerator] = type(accelerator)
        name = _accelerator_name(accelerator_cls)
    else:
        name = "cuda" if accelerator == "gpu" else accelerator
        if name == "auto":
            name = "cuda" if AcceleratorRegistry.get("cuda").is_available() else "cpu"
        if name not in AcceleratorRegistry:
            raise ValueError(
                f"unknown accelerator {accelerator!r};"
                f" choose one of: auto, gpu, {', '.join(AcceleratorRegistry)}"
            )
        accelerator_cls = type(AcceleratorRegistry.get(name))
    if devices == "auto":
        count = accelerator_cls.auto_device_count()
        # Lightning itself uses one GPU for devices="auto" in an interactive session
        devices = 1 if facts.interactive and name == "cuda" else count
    try:
        parsed = accelerator_cls.parse_devices(devices)
    except (TypeError, MisconfigurationException) as err:  # Lightning's words for a value it refuses
        raise ValueError(f"devices={devices!r}: {err}") from err
    return len(accelerator_cls.get_parallel_devices(parsed)), name


def choose_strategy(
    devices: int | str | list[int] = "auto",
    num_nodes: int = 1,
    accelerator: str | Accelerator = "auto",
    facts: EnvironmentFacts | None = None,
    model: Any = None,
    device_memory: int | str | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    precision: str = "32-true",
) -> StrategyChoice:
    """The strategy ``Trainer(strategy="mgpu_auto")`` would use with these arguments, and why.

    Args:
        devices: as for the Trainer: a count, a list of indices or ``"auto"``.
        num_nodes: as for the Trainer.
        accelerator: as for the Trainer.
        facts: the environment; read from this process when ``None``.
        model: the model to train (an ``nn.Module``, meta tensors welcome): with a known device
            memory, ``mgpu_fsdp`` is chosen over ``mgpu_ddp`` when only its shards (parameters,
            gradients and optimizer state) fit a device.
        device_memory: memory of one device (``"24GiB"`` or bytes); ``None`` reads the smallest
            CUDA device when the accelerator is CUDA.
        optimizer: the optimizer over ``model``'s parameters, whose state is counted; ``None`` uses
            the model's ``configure_optimizers()`` where it has one.
        precision: the Trainer's precision, for the bytes the parameters and their state will take.

    Raises:
        ValueError: on devices the accelerator cannot provide (Lightning's message, e.g. ``[0]``
            or ``-1`` with the CPU accelerator), an unknown accelerator, or ``num_nodes < 1``.

    Example::

        import lightning_mgpu

        choice = lightning_mgpu.choose_strategy(devices=2)
        print(choice.strategy, "-", choice.reason)
    """
    if not isinstance(num_nodes, int) or num_nodes < 1:
        raise ValueError(f"`num_nodes` must be a positive integer, got {num_nodes!r}")
    facts = facts if facts is not None else EnvironmentFacts.detect()
    count, device_type = _resolve_devices(devices, accelerator, facts)
    memory = None
    if model is not None:
        size = device_memory_of(device_memory, device_type)
        if size is not None:
            memory = model_memory(model, count * num_nodes, size, precision, optimizer)
            log.debug("model memory: %s", memory)
    return decide(count, num_nodes, device_type, facts, memory)


class MGPUAutoStrategy(ParallelStrategy):
    """Placeholder registered as ``mgpu_auto``: becomes the strategy ``choose_strategy`` picks.

    See the module docstring for the rules and for how the Trainer's settings reach it. Where it
    starts one process per device (``mgpu_ddp``, ``mgpu_fsdp``, ``ddp_notebook``) and the Trainer has
    no ``DeviceTimeMonitor``, it adds one (``summary_file=None``): the run ends with every rank's
    time table and the name of a slow rank.

    Args:
        facts: the environment facts to decide with; read from this process when ``None``.
        device_memory: memory of one device (``"24GiB"`` or bytes), as for ``choose_strategy``;
            ``None`` reads the smallest CUDA device on CUDA, and is unknown elsewhere. Where
            ``mgpu_ddp`` is chosen and the memory is known, the model decides between it and
            ``mgpu_fsdp`` when the Trainer connects it (module docstring).
        micro_batch_size: ``None`` (off), a number of rows or ``"auto"``: passed on to the chosen
            strategy (see ``MGPUDDPStrategy``); one device and ``ddp_notebook`` give way to
            ``mgpu_dp``, which micro-batches.
        resume: As for ``MGPUDDPStrategy``: a restarted ``fit`` resumes by itself.
        checkpoint_every: As for ``MGPUDDPStrategy``: a resumable checkpoint every N steps or minutes.
        requeue_on_failure: As for ``MGPUDDPStrategy``: requeue a SLURM job after a failed task.
            The three are passed on to ``mgpu_ddp`` and ``mgpu_fsdp``; the other choices (one device,
            ``mgpu_dp``, ``ddp_notebook``) run in one process, and a warning names those set.
        process_group_backend: As for ``MGPUDDPStrategy``; replaces the ``"gloo"`` chosen where NCCL is
            missing.
        timeout: As for ``MGPUDDPStrategy``: how long a collective may wait.
        stall_timeout: As for ``MGPUDDPStrategy``: seconds without progress before the watchdog stops
            every rank. The three are passed on to ``mgpu_ddp`` and ``mgpu_fsdp``, and
            ``process_group_backend`` and ``timeout`` to ``ddp_notebook``; a choice that does not take
            one that was set (one device and ``mgpu_dp`` have no process group, ``ddp_notebook`` no
            watchdog) warns, naming it, and runs without it. The chosen strategy checks their values.

    Raises:
        ValueError: a ``device_memory`` that is not a size, a ``micro_batch_size`` that is not a
            positive int, ``"auto"`` or ``None``, or a ``resume``, ``checkpoint_every`` or
            ``requeue_on_failure`` that is none of those ``MGPUDDPStrategy`` accepts.

    Example::

        import lightning as L
        import lightning_mgpu

        trainer = L.Trainer(accelerator="gpu", devices=2, strategy="mgpu_auto")
        # on CPU, or to plan for smaller cards: the model decides between mgpu_ddp and mgpu_fsdp
        strategy = lightning_mgpu.MGPUAutoStrategy(device_memory="24GiB", micro_batch_size="auto")
    """

    strategy_name = "mgpu_auto"

    def __init__(
        self,
        facts: EnvironmentFacts | None = None,
        *,
        device_memory: int | str | None = None,
        micro_batch_size: int | str | None = None,
        resume: bool | None = DEFAULTS["resume"],
        checkpoint_every: int | timedelta | str | None = DEFAULTS["checkpoint_every"],
        requeue_on_failure: int = DEFAULTS["requeue_on_failure"],
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        stall_timeout: float | None = STALL_TIMEOUT,
    ) -> None:
        super().__init__()
        self.facts = facts
        self.device_memory = None if device_memory is None else parse_bytes(device_memory)
        self.micro_batch_size = check_micro_batch_size(micro_batch_size)
        self.resumption = check_options(resume, checkpoint_every, requeue_on_failure)
        given: dict[str, tuple[Any, Any]] = {"process_group_backend": (process_group_backend, None)}
        given.update(timeout=(timeout, default_pg_timeout), stall_timeout=(stall_timeout, STALL_TIMEOUT))
        # those given (not left at their defaults), passed on where taken
        self.process_group = {name: value for name, (value, default) in given.items() if value != default}
        self.num_nodes = 1
        self.choice: StrategyChoice | None = None

    @override
    def _configure_launcher(self) -> None:
        devices = list(self.parallel_devices or [])
        # a custom accelerator may list objects of its own (strings, say) rather than torch.device
        device_type = str(getattr(devices[0], "type", devices[0])) if devices else "cpu"
        facts = self.facts if self.facts is not None else EnvironmentFacts.detect()
        choice = with_micro_batching(
            decide(len(devices), self.num_nodes, device_type, facts), self.micro_batch_size
        )
        self._warn_left_out(choice)
        choice = with_options(choice, self._passed_on())
        memory = device_memory_of(self.device_memory, device_type) if choice.strategy == "mgpu_ddp" else None
        if memory is None:
            rank_zero_info(f"mgpu_auto chose {choice.strategy}: {choice.reason}")
            become(self, choice, devices)
        else:
            rank_zero_info(
                f"mgpu_auto chose mgpu_ddp: {choice.reason}; unless the model needs sharding (a whole copy"
                " of its parameters, gradients and optimizer state does not fit the"
                f" {format_bytes(memory)} of a device, their shards do), then mgpu_fsdp: decided when the"
                " model is known"
            )
            redecide = functools.partial(decide, len(devices), self.num_nodes, device_type, facts)
            pending = PendingChoice(
                redecide, memory, len(devices) * self.num_nodes, self.micro_batch_size, self._passed_on()
            )
            become(self, choice, devices, strategy_class=PendingDDPStrategy)
            self.pending = pending  # self is a PendingDDPStrategy now

    def _passed_on(self) -> dict[str, Any]:
        """What the chosen strategy gets where it takes it (``decide.TAKES``)."""
        return {**self.resumption, **self.process_group}

    def _warn_left_out(self, choice: StrategyChoice) -> None:
        given = {name: value for name, value in self.resumption.items() if value != DEFAULTS[name]}
        given.update(self.process_group)
        unused = left_out(choice, given)
        if not unused:
            return
        it = "it" if len(unused) == 1 else "them"
        resume = any(name in self.resumption for name in unused)
        rank_zero_warn(
            f"mgpu_auto chose {choice.strategy}, which does not take"
            f" {', '.join(f'{name}={given[name]!r}' for name in unused)}: mgpu_ddp and mgpu_fsdp take {it},"
            f" and this run goes on without {it}."
            + (" Pass `ckpt_path` to `Trainer.fit` to resume this run." if resume else "")
        )

    def _undecided(self) -> RuntimeError:
        return RuntimeError(
            "mgpu_auto decides when the Trainer configures it; pass it to `Trainer(strategy=...)`"
        )

    @property
    @override
    def root_device(self) -> torch.device:
        raise self._undecided()

    @override
    def model_to_device(self) -> None:
        raise self._undecided()

    @override
    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        raise self._undecided()

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        raise self._undecided()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        raise self._undecided()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="picks mgpu_ddp, mgpu_fsdp, mgpu_dp, ddp_notebook or one device for the code, model",
            override=True,
        )
