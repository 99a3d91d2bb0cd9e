"""``mgpu_auto`` and ``choose_strategy``: pick the multi-device strategy that works where the code runs.

``choose_strategy(devices=..., num_nodes=...)`` decides, from the number of devices and
the facts of the environment, in this order:

- several nodes, or a process started by torchrun, SLURM or a launcher that set
  ``LOCAL_RANK``: ``mgpu_ddp``, the processes already exist or must be started per node;
- one device: ``single_device``, nothing to parallelise;
- ``torch.distributed`` missing from this torch build: ``mgpu_dp``, one process needs no
  process group;
- several devices in a script: ``mgpu_ddp``;
- several devices in an interactive session (Jupyter, IPython, ``python -i``) where CUDA
  is already initialised: ``mgpu_dp``, because forking a process after CUDA is initialised
  is impossible (Lightning's ``ddp_notebook`` raises there);
- the same on a platform without ``fork`` (Windows): ``mgpu_dp``;
- several devices in an interactive session otherwise: Lightning's ``ddp_notebook``.

Given the model, and the device memory (CUDA's, or ``device_memory=``), where the rules above
pick ``mgpu_ddp``: ``mgpu_fsdp`` when a whole copy of the parameters and gradients does not
fit one device while their shards and the largest gathered unit do, the reason giving the
numbers (``model_memory.py``; optimizer state and activations come on top); when even the
shards do not fit, ``mgpu_ddp`` stays, its reason saying so and how many devices would do.

On CUDA without NCCL (Windows builds) the DDP choices use the ``gloo`` backend.
``devices="auto"`` means every GPU in a script but one GPU in an interactive session,
because that is how Lightning resolves it there: pass ``devices=N`` in a notebook.

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
in every process (``auto_model.PendingDDPStrategy``): ``mgpu_fsdp`` by the rule above, logged
with the numbers (``mgpu_ddp`` stays, with a warning, under a precision ``mgpu_fsdp``
refuses), and a ``ValueError`` with the numbers when even the shards do not fit, before
anything is moved. ``micro_batch_size=`` is passed on to the chosen strategy; one device
and ``ddp_notebook``, which cannot micro-batch, give way to ``mgpu_dp``.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.accelerators import Accelerator, AcceleratorRegistry
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_mgpu.devices import format_bytes, parse_bytes
from lightning_mgpu.strategies.auto_facts import EnvironmentFacts
from lightning_mgpu.strategies.auto_model import (
    PendingChoice,
    PendingDDPStrategy,
    become,
    with_micro_batching,
)
from lightning_mgpu.strategies.microbatch.mixin import check_micro_batch_size
from lightning_mgpu.strategies.model_memory import (
    ModelMemory,
    device_memory_of,
    model_memory,
    sharding_reason,
    shortfall_reason,
)

__all__ = [
    "EnvironmentFacts",
    "MGPUAutoStrategy",
    "StrategyChoice",
    "choose_strategy",
    "decide",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StrategyChoice:
    """The strategy ``mgpu_auto`` picks, and why.

    Example::

        from lightning_mgpu import choose_strategy

        choice = choose_strategy(devices=4)
        print(choice)
        # run from a script: "mgpu_ddp: 4 devices in a script: one process per device";
        # typed at a prompt or in a notebook the answer is ddp_notebook or mgpu_dp
    """

    strategy: str
    """A registered name: ``mgpu_ddp``, ``mgpu_fsdp``, ``mgpu_dp``, ``ddp_notebook`` or ``single_device``."""
    reason: str
    devices: int
    num_nodes: int = 1
    options: dict[str, Any] = field(default_factory=dict)
    """Extra arguments for the strategy, such as ``process_group_backend="gloo"``."""

    def __str__(self) -> str:
        return f"{self.strategy}: {self.reason}"


def decide(
    devices: int,
    num_nodes: int,
    device_type: str,
    facts: EnvironmentFacts,
    memory: ModelMemory | None = None,
) -> StrategyChoice:
    """The decision for ``devices`` devices (already resolved) of type ``device_type`` per node.

    ``choose_strategy`` resolves the Trainer-style arguments and calls this; the rules are
    listed in the module docstring. ``memory`` is what the model needs, when known.

    Example::

        facts = EnvironmentFacts.detect(interactive=True, cuda_initialized=True)
        decide(4, 1, "cuda", facts).strategy  # 'mgpu_dp'
    """

    def choice(strategy: str, reason: str, **options: Any) -> StrategyChoice:
        if (
            strategy != "mgpu_dp"
            and strategy != "single_device"
            and device_type == "cuda"
            and not facts.nccl_available
        ):
            options["process_group_backend"] = "gloo"
            reason += "; NCCL is missing from this torch build, so the gloo backend is used"
        log.debug("%d %s device(s) x %d node(s), %s", devices, device_type, num_nodes, facts)
        log.debug("-> %s: %s", strategy, reason)
        return StrategyChoice(strategy, reason, devices, num_nodes, options)

    def processes(why: str) -> StrategyChoice:
        if memory is not None and memory.needs_sharding:
            return choice("mgpu_fsdp", f"{why}: one process per device; {sharding_reason(memory)}")
        reason = f"{why}: one process per device"
        if memory is not None and memory.fits_nowhere:
            reason += f"; but {shortfall_reason(memory)}"
        return choice("mgpu_ddp", reason)

    if num_nodes > 1 or facts.launcher is not None:
        if not facts.distributed_available:
            raise ValueError(
                "several processes need torch.distributed, which this torch build lacks;"
                " install a torch build with distributed support"
            )
        return processes(f"{num_nodes} nodes" if num_nodes > 1 else f"started by {facts.launcher}")
    if devices <= 1:
        return choice("single_device", f"one {device_type} device: nothing to split")
    if not facts.distributed_available:
        return choice(
            "mgpu_dp", f"{devices} devices but no torch.distributed in this build: one process drives all"
        )
    if not facts.interactive:
        return processes(f"{devices} devices in a script")
    if facts.cuda_initialized:
        return choice(
            "mgpu_dp",
            f"{devices} devices in an interactive session where CUDA is already initialised:"
            " processes cannot be forked any more, so one process drives all devices",
        )
    if not facts.fork_available:
        return choice(
            "mgpu_dp",
            f"{devices} devices in an interactive session on a platform without fork:"
            " one process drives all devices",
        )
    return choice(
        "ddp_notebook",
        f"{devices} devices in an interactive session before CUDA is initialised: forked processes",
    )


def _resolve_devices(
    devices: int | str | list[int], accelerator: str | Accelerator, facts: EnvironmentFacts
) -> tuple[int, str]:
    if isinstance(accelerator, Accelerator):
        accelerator_cls: type[Accelerator] = type(accelerator)
    else:
        name = accelerator
        if name == "auto":
            name = "cuda" if AcceleratorRegistry.get("cuda").is_available() else "cpu"
        elif name == "gpu":
            name = "cuda"
        if name not in AcceleratorRegistry:
            raise ValueError(
                f"unknown accelerator {accelerator!r};"
                f" choose one of: auto, gpu, {', '.join(AcceleratorRegistry)}"
            )
        accelerator_cls = type(AcceleratorRegistry.get(name))
    if devices == "auto":
        count = accelerator_cls.auto_device_count()
        # Lightning itself uses one GPU for devices="auto" in an interactive session
        devices = 1 if facts.interactive and accelerator_cls.name() == "cuda" else count
    try:
        parsed = accelerator_cls.parse_devices(devices)
    except (TypeError, MisconfigurationException) as err:  # Lightning's words for a value it refuses
        raise ValueError(f"devices={devices!r}: {err}") from err
    return len(accelerator_cls.get_parallel_devices(parsed)), accelerator_cls.name()


def choose_strategy(
    devices: int | str | list[int] = "auto",
    num_nodes: int = 1,
    accelerator: str | Accelerator = "auto",
    facts: EnvironmentFacts | None = None,
    model: Any = None,
    device_memory: int | str | None = None,
) -> StrategyChoice:
    """The strategy ``Trainer(strategy="mgpu_auto")`` would use with these arguments, and why.

    Args:
        devices: as for the Trainer: a count, a list of indices or ``"auto"``.
        num_nodes: as for the Trainer.
        accelerator: as for the Trainer.
        facts: the environment; read from this process when ``None``.
        model: the model to train (an ``nn.Module``, meta tensors welcome): with a known device
            memory, ``mgpu_fsdp`` is chosen over ``mgpu_ddp`` when only its shards fit a device.
        device_memory: memory of one device (``"24GiB"`` or bytes); ``None`` reads the smallest
            CUDA device when the accelerator is CUDA.

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
            memory = model_memory(model, count * num_nodes, size)
            log.debug("model memory: %s", memory)
    return decide(count, num_nodes, device_type, facts, memory)


class MGPUAutoStrategy(ParallelStrategy):
    """Placeholder registered as ``mgpu_auto``: becomes the strategy ``choose_strategy`` picks.

    See the module docstring for the rules and for how the Trainer's settings reach it.

    Args:
        facts: the environment facts to decide with; read from this process when ``None``.
        device_memory: memory of one device (``"24GiB"`` or bytes), as for ``choose_strategy``;
            ``None`` reads the smallest CUDA device on CUDA, and is unknown elsewhere. Where
            ``mgpu_ddp`` is chosen and the memory is known, the model decides between it and
            ``mgpu_fsdp`` when the Trainer connects it (module docstring).
        micro_batch_size: ``None`` (off), a number of rows or ``"auto"``: passed on to the chosen
            strategy (see ``MGPUDDPStrategy``); one device and ``ddp_notebook`` give way to
            ``mgpu_dp``, which micro-batches.

    Raises:
        ValueError: a ``device_memory`` that is not a size, a ``micro_batch_size`` that is not a
            positive int, ``"auto"`` or ``None``.

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
    ) -> None:
        super().__init__()
        self.facts = facts
        self.device_memory = None if device_memory is None else parse_bytes(device_memory)
        self.micro_batch_size = check_micro_batch_size(micro_batch_size)
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
        memory = device_memory_of(self.device_memory, device_type) if choice.strategy == "mgpu_ddp" else None
        if memory is None:
            rank_zero_info(f"mgpu_auto chose {choice.strategy}: {choice.reason}")
            become(self, choice, devices)
        else:
            rank_zero_info(
                f"mgpu_auto chose mgpu_ddp: {choice.reason}; unless the model needs sharding (its parameters"
                f" and gradients do not fit the {format_bytes(memory)} of a device, their shards do), then"
                " mgpu_fsdp: decided when the model is known"
            )
            redecide = functools.partial(decide, len(devices), self.num_nodes, device_type, facts)
            pending = PendingChoice(redecide, memory, len(devices) * self.num_nodes, self.micro_batch_size)
            become(self, choice, devices, strategy_class=PendingDDPStrategy)
            self.pending = pending  # self is a PendingDDPStrategy now

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
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="picks mgpu_ddp, mgpu_fsdp, mgpu_dp, ddp_notebook or one device for the code, model",
            override=True,
        )
