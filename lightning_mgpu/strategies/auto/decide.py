"""The decision of ``mgpu_auto``: which multi-device strategy works where the code runs, and why.

``decide`` is the pure decision of ``mgpu_auto`` and ``choose_strategy``: plain facts in (devices, nodes,
``EnvironmentFacts``, the model's ``ModelMemory``), a ``StrategyChoice`` with its reason out;
``EnvironmentFacts.detect()`` reads the facts from this process. The rules, in this order:

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
pick ``mgpu_ddp``: ``mgpu_fsdp`` when a whole copy of the parameters, gradients and optimizer state
(with DDP's gradient buckets) does not fit one device while their shards and the largest gathered
unit do, the reason giving the numbers (``model_memory.py``, the estimate's arithmetic; activations
come on top); when even the shards do not fit, ``mgpu_ddp`` stays, its reason saying so and how many
devices would do.

On CUDA without NCCL (Windows builds) the DDP choices use the ``gloo`` backend.
``devices="auto"`` means every GPU in a script but one GPU in an interactive session,
because that is how Lightning resolves it there: pass ``devices=N`` in a notebook.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

from lightning_mgpu._words import counted
from lightning_mgpu.strategies.auto.model_memory import (
    ModelMemory,
    fitting_reason,
    sharding_reason,
    shortfall_reason,
)

__all__ = [
    "PROCESS_GROUP_OPTIONS",
    "EnvironmentFacts",
    "TAKES",
    "StrategyChoice",
    "decide",
    "left_out",
    "with_micro_batching",
    "with_options",
]

log = logging.getLogger(__name__)

PROCESS_GROUP_OPTIONS = ("process_group_backend", "timeout", "stall_timeout")
"""What ``mgpu_auto`` takes for the process group of the strategy it becomes."""

_RESUMPTION_OPTIONS = ("resume", "checkpoint_every", "requeue_on_failure")
TAKES: dict[str, tuple[str, ...]] = {
    "mgpu_ddp": _RESUMPTION_OPTIONS + PROCESS_GROUP_OPTIONS,
    "mgpu_fsdp": _RESUMPTION_OPTIONS + PROCESS_GROUP_OPTIONS,
    "ddp_notebook": ("process_group_backend", "timeout"),  # Lightning's DDPStrategy: no watchdog
}
"""The options ``mgpu_auto`` passes on, by the choice that takes them; one device and ``mgpu_dp`` run in
one process, without a process group, and take none of them."""


def _interactive() -> bool:
    if hasattr(sys, "ps1") or sys.flags.interactive:
        return True
    ipython = sys.modules.get("IPython")
    return ipython is not None and getattr(ipython, "get_ipython", lambda: None)() is not None


def _launcher() -> str | None:
    if TorchElasticEnvironment.detect():
        return "torchrun"
    if SLURMEnvironment.detect():
        return "SLURM"
    if "LOCAL_RANK" in os.environ:
        return "a launcher (LOCAL_RANK is set)"
    return None


@dataclass(frozen=True)
class EnvironmentFacts:
    """What ``choose_strategy`` reads from the environment. ``detect()`` reads them; tests may set any.

    Example::

        facts = EnvironmentFacts.detect(interactive=True, cuda_initialized=True)
        choose_strategy(devices=2, facts=facts).strategy  # 'mgpu_dp'
    """

    interactive: bool
    """A notebook, IPython or ``python -i`` session."""
    cuda_initialized: bool
    """``torch.cuda.is_initialized()``: fork-based DDP is impossible afterwards."""
    launcher: str | None
    """The tool that started this process as one of several ranks (torchrun, SLURM), if any."""
    fork_available: bool
    """Whether the ``fork`` start method exists on this platform."""
    nccl_available: bool
    """Whether this torch build has NCCL."""
    distributed_available: bool
    """Whether this torch build has ``torch.distributed``."""

    @classmethod
    def detect(cls, **overrides: Any) -> EnvironmentFacts:
        """Read every fact from this process, then apply ``overrides`` (fact name -> value)."""
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(
                f"unknown environment facts {sorted(unknown)};"
                f" known: {[f.name for f in dataclasses.fields(cls)]}"
            )
        distributed = torch.distributed.is_available()
        facts = cls(
            interactive=_interactive(),
            cuda_initialized=torch.cuda.is_initialized(),
            launcher=_launcher(),
            fork_available="fork" in torch.multiprocessing.get_all_start_methods(),
            nccl_available=distributed and torch.distributed.is_nccl_available(),
            distributed_available=distributed,
        )
        return dataclasses.replace(facts, **overrides)


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
            strategy not in ("mgpu_dp", "single_device")
            and device_type == "cuda"
            and not facts.nccl_available
        ):
            options["process_group_backend"] = "gloo"
            reason += "; NCCL is missing from this torch build, so the gloo backend is used"
        where = f"{counted(devices, device_type + ' device')} x {counted(num_nodes, 'node')}"
        log.debug("%s, %s", where, facts)
        log.debug("-> %s: %s", strategy, reason)
        return StrategyChoice(strategy, reason, devices, num_nodes, options)

    def processes(why: str) -> StrategyChoice:
        if memory is not None and memory.needs_sharding:
            return choice("mgpu_fsdp", f"{why}: one process per device; {sharding_reason(memory)}")
        reason = f"{why}: one process per device"
        if memory is not None and memory.fits_nowhere:
            reason += f"; but {shortfall_reason(memory)}"
        elif memory is not None and memory.whole:
            reason += f"; {fitting_reason(memory)}"
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


def with_micro_batching(choice: StrategyChoice, micro_batch_size: int | str | None) -> StrategyChoice:
    """``choice`` with ``micro_batch_size`` among its options, on a strategy that micro-batches.

    ``single_device`` and Lightning's ``ddp_notebook`` cannot: ``mgpu_dp`` takes their place,
    on the same devices, in this one process.
    """
    if micro_batch_size is None:
        return choice
    options = {**choice.options, "micro_batch_size": micro_batch_size}
    if choice.strategy not in ("single_device", "ddp_notebook"):
        return dataclasses.replace(choice, options=options)
    options.pop("process_group_backend", None)  # one process: no process group
    was = "a single device" if choice.strategy == "single_device" else "Lightning's ddp_notebook"
    reason = f"{choice.reason}; micro_batch_size={micro_batch_size!r}, which {was} cannot run, so mgpu_dp"
    return dataclasses.replace(choice, strategy="mgpu_dp", reason=reason, options=options)


def with_options(choice: StrategyChoice, options: dict[str, Any]) -> StrategyChoice:
    """``choice`` with those of ``options`` its strategy takes (:data:`TAKES`) among its options.

    A value given here replaces the decision's own (``process_group_backend="gloo"`` without NCCL).
    """
    taken = {name: value for name, value in options.items() if name in TAKES.get(choice.strategy, ())}
    if not taken:
        return choice
    return dataclasses.replace(choice, options={**choice.options, **taken})


def left_out(choice: StrategyChoice, options: dict[str, Any]) -> list[str]:
    """The names of ``options`` that ``choice``'s strategy does not take (:data:`TAKES`)."""
    return [name for name in options if name not in TAKES.get(choice.strategy, ())]
