"""``EnvironmentFacts``: what ``choose_strategy`` (and ``mgpu_auto``) read from the environment."""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

__all__ = ["EnvironmentFacts"]


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
