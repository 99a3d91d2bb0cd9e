"""How ``DeviceTimeMonitor`` times a batch: waiting for the other ranks, and CUDA events read later.

- ``AllReduceTimer``: a DDP communication hook around the default all-reduce that notes when
  the rank's last gradient bucket was handed over (its own backward done) and when the last
  all-reduce completed; the difference is the time the rank was blocked on the others;
- ``ShardedCollectiveTimer``: under ``mgpu_fsdp`` on CPU, the host time inside FSDP's all-gathers
  and reduce-scatters, which the strategy counts (``collective_seconds``); gloo runs them on the
  training thread, so the rank computes nothing meanwhile;
- ``CudaStep``: one batch timed on the GPU by ``torch.cuda.Event`` pairs, read once they have
  completed, so timing adds no synchronisation.
"""

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from lightning_mgpu._compat.lightning import ddp_comm_hook

__all__ = ["AllReduceTimer", "CudaStep", "ShardedCollectiveTimer", "StepTimer", "attach_timer"]

log = logging.getLogger(__name__)

Events = list[tuple[torch.cuda.Event, torch.cuda.Event]]


class StepTimer(Protocol):
    """What the monitor needs of a waiting timer: a batch's start and end, and its release."""

    def begin_step(self) -> None: ...

    def end_step(self) -> float | Events:
        """Seconds blocked on the other ranks in this batch; on CUDA the events that measure it."""
        ...

    def detach(self) -> None: ...


def attach_timer(trainer: Trainer, cuda: torch.device | None) -> StepTimer | None:
    """The timer of the strategy's collectives: DDP's all-reduce, FSDP's on CPU; ``None`` elsewhere."""
    timer = AllReduceTimer.attach(trainer, cuda)
    if timer is None and cuda is None and getattr(trainer.strategy, "collective_seconds", None) is not None:
        return ShardedCollectiveTimer(trainer.strategy)
    return timer


class AllReduceTimer:
    """The state of the timing communication hook of one ``DistributedDataParallel`` model."""

    def __init__(self, group: Any, cuda: torch.device | None) -> None:
        self.group = group
        self.cuda = cuda
        """The rank's CUDA device, timed with events; ``None`` on CPU (host clock)."""
        self.active = True
        self._launched = 0.0
        self._done = 0.0
        self._start: torch.cuda.Event | None = None
        self._stop: torch.cuda.Event | None = None

    @classmethod
    def attach(cls, trainer: Trainer, cuda: torch.device | None) -> "AllReduceTimer | None":
        """Register the hook on the strategy's DDP model; ``None`` when there is none, or it has a hook."""
        model = getattr(trainer.strategy, "model", None)
        if not isinstance(model, DistributedDataParallel):
            return None
        if ddp_comm_hook(trainer.strategy) is not None:
            log.debug("the strategy has a ddp_comm_hook: waiting for the other ranks is not measured")
            return None
        timer = cls(model.process_group, cuda)
        try:
            model.register_comm_hook(timer, _timed_allreduce)
        except RuntimeError as err:  # one hook per model, registered before the first backward
            log.debug("no timing hook on this DDP model (%s): waiting is not measured", err)
            return None
        return timer

    def detach(self) -> None:
        """DDP keeps a hook for good: from now on it only runs the default all-reduce."""
        self.active = False

    def begin_step(self) -> None:
        self._launched = self._done = 0.0
        self._start = self._stop = None

    def end_step(self) -> float | Events:
        """Seconds blocked on the other ranks in this batch; on CUDA the events that measure it."""
        if self.cuda is not None:
            return [(self._start, self._stop)] if self._start is not None and self._stop is not None else []
        return max(0.0, self._done - self._launched) if self._launched else 0.0

    def launched(self) -> None:
        # buckets are handed over in order on the training thread: the last call is the end of backward
        if self.cuda is not None:
            self._start = _recorded(self.cuda)
        else:
            self._launched = time.perf_counter()

    def completed(self, future: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        if self.cuda is not None:  # in a CUDA future's callback the current stream waits for the all-reduce
            self._stop = _recorded(self.cuda)
        else:
            self._done = max(self._done, time.perf_counter())
        return future.value()


class ShardedCollectiveTimer:
    """The host time of one batch inside FSDP's collectives, from the strategy's running sum.

    Gloo runs FSDP2's all-gathers and reduce-scatters on the calling thread (neither is issued
    asynchronously unless a unit's ``unshard_async_op`` is set), so the time inside them is time the
    rank waits for the others, plus the transfer, as the DDP timer's. On CUDA they run on streams of
    their own beside the computation, and the share of it the computation waits for is not seen
    from the host without a profiler: no timer there (``attach_timer`` gives ``None``).
    """

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self._at_start = 0.0

    def detach(self) -> None:
        """Nothing was registered: the strategy counts the time anyway."""

    def begin_step(self) -> None:
        self._at_start = self.strategy.collective_seconds or 0.0

    def end_step(self) -> float:
        return max(0.0, (self.strategy.collective_seconds or 0.0) - self._at_start)


# the annotations are real objects (no ``from __future__ import annotations`` here): DDP compares them
def _timed_allreduce(timer: AllReduceTimer, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    if not timer.active:
        return default_hooks.allreduce_hook(timer.group, bucket)
    timer.launched()
    return default_hooks.allreduce_hook(timer.group, bucket).then(timer.completed)


@dataclass
class CudaStep:
    """One batch timed on the GPU: start and end events, and the all-reduce's events."""

    device: torch.device
    start: torch.cuda.Event = field(init=False)
    stop: torch.cuda.Event | None = None
    wait: Events | None = None

    def __post_init__(self) -> None:
        self.start = _recorded(self.device)

    def end(self, wait: float | Events | None) -> None:
        self.stop = _recorded(self.device)
        self.wait = None if wait is None else wait if isinstance(wait, list) else []

    def done(self, block: bool) -> bool:
        """Whether every event has completed, without waiting for the GPU unless ``block``."""
        if self.stop is None:
            return False
        if block:
            self.stop.synchronize()
        return bool(self.stop.query()) and all(b.query() for _, b in self.wait or [])

    def seconds(self) -> tuple[float, float | None]:
        if self.stop is None:
            raise RuntimeError("CudaStep.seconds() before end()")
        step = self.start.elapsed_time(self.stop) / 1e3
        if self.wait is None:
            return step, None
        return step, sum(a.elapsed_time(b) for a, b in self.wait) / 1e3


def _recorded(device: torch.device) -> torch.cuda.Event:
    """An event recorded now on ``device``'s current stream (a callback's thread may have another device)."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event
