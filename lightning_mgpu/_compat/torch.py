"""What each feature needs of torch beyond the declared floor: checked when the feature is used, in one line.

The package installs over any torch from the floor in ``pyproject.toml`` up, so that an environment's
own torch (a cluster image, a CUDA build) is kept. A feature that needs more than the floor is listed
here once, with the release that first has it and how to tell (an attribute, not a version string, so
that nightly and vendor builds are judged by what they hold). Where it is used, ``require`` refuses it
on an older torch with one line naming that release and what to do instead; nothing runs half-way.

- ``FSDP_ON_CPU``: ``mgpu_fsdp`` on CPU processes. FSDP2 records events on the current stream, which
  ``torch.cpu.Stream`` can do from torch 2.7 (on 2.6 torch raises ``AttributeError: 'Stream' object has no
  attribute 'record_event'``).
- ``FSDP_FORCE_SUM``: ``mgpu_fsdp`` where gloo's reduce-scatter sums when asked to average (torch 2.7 and
  2.8, pytorch/pytorch#162338): FSDP is made to sum and divide itself, with
  ``FSDPModule.set_force_sum_reduction_for_comms`` (torch 2.8); ``strategies/fsdp/gloo_average.py``.
- ``FSDP_RESET_ITER_STATE``: ``micro_batch_size="auto"`` under ``mgpu_fsdp``, which resets a pass abandoned
  after an out-of-memory with ``FSDPModule.reset_iter_state`` (torch 2.13).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FSDPModule

__all__ = [
    "FEATURES",
    "FSDP_FORCE_SUM",
    "FSDP_ON_CPU",
    "FSDP_RESET_ITER_STATE",
    "TorchFeature",
    "require",
]


@dataclass(frozen=True)
class TorchFeature:
    """A feature that needs a newer torch than the floor.

    Args:
        name: The feature as a user asks for it, e.g. ``"micro_batch_size='auto' under mgpu_fsdp"``.
        since: The first torch release that has what it needs, e.g. ``"2.13"``.
        needs: What that release added, e.g. ``"FSDPModule.reset_iter_state"``.
        instead: What to do on an older torch besides upgrading, e.g. ``"use a fixed micro_batch_size"``.
        present: Whether this torch has it (looked up, not read from the version string).
    """

    name: str
    since: str
    needs: str
    instead: str
    present: Callable[[], bool]

    def message(self) -> str:
        """The one line that refuses the feature on this torch."""
        return (
            f"{self.name} needs torch>={self.since} ({self.needs}), and this is torch {torch.__version__}:"
            f" upgrade torch, or {self.instead}"
        )


def _cpu_stream_records_events() -> bool:
    return hasattr(torch.cpu.Stream, "record_event")


def _fsdp_forces_sum() -> bool:
    return hasattr(FSDPModule, "set_force_sum_reduction_for_comms")


def _fsdp_resets_iter_state() -> bool:
    return hasattr(FSDPModule, "reset_iter_state")


FSDP_ON_CPU = TorchFeature(
    name="mgpu_fsdp on CPU",
    since="2.7",
    needs="torch.cpu.Stream.record_event, which FSDP2 calls",
    instead="train on GPUs (accelerator='gpu'), or use strategy='mgpu_ddp' on CPU",
    present=_cpu_stream_records_events,
)
FSDP_FORCE_SUM = TorchFeature(
    name="mgpu_fsdp over gloo on this torch, whose reduce-scatter sums when asked to average"
    " (pytorch/pytorch#162338)",
    since="2.8",
    needs="FSDPModule.set_force_sum_reduction_for_comms, to sum and divide instead",
    instead="train on GPUs with NCCL, or use strategy='mgpu_ddp'",
    present=_fsdp_forces_sum,
)
FSDP_RESET_ITER_STATE = TorchFeature(
    name="micro_batch_size='auto' under mgpu_fsdp",
    since="2.13",
    needs="FSDPModule.reset_iter_state",
    instead="use a fixed micro_batch_size",
    present=_fsdp_resets_iter_state,
)

FEATURES = (FSDP_ON_CPU, FSDP_FORCE_SUM, FSDP_RESET_ITER_STATE)
"""Every feature above, for the test that each is present exactly from the release it names."""


def require(feature: TorchFeature) -> None:
    """Refuse ``feature`` on a torch that lacks it.

    Raises:
        RuntimeError: This torch lacks the feature; the message names the release that has it.
    """
    if not feature.present():
        raise RuntimeError(feature.message())
