"""One step of ``mgpu_dp``: the batch cut per replica, the replicas run in threads, the results made one.

``ReplicaStep.run`` serves ``training_step``, ``validation_step``, ``test_step`` and ``predict_step``
alike: it replicates the module on each device, gives each replica its chunk, its own copies of the
module's metrics and a ``self.log`` that records, runs them at once (``ReplicaThreads``), then
merges the metrics, replays the logs once and combines the outputs on the first device.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_mgpu._words import counted
from lightning_mgpu.losses import replica_step_context
from lightning_mgpu.strategies.dp.lockstep import Lockstep, manual_optimization_hooks
from lightning_mgpu.strategies.dp.replicas import (
    ReplicaCall,
    compiled_submodules,
    prepare_replica,
    refresh_parameters,
    replicate,
)
from lightning_mgpu.strategies.dp.threads import ReplicaThreads
from lightning_mgpu.strategies.split.batch import combine_outputs, scatter_batch, split_rows, split_sizes
from lightning_mgpu.strategies.split.logs import LogCapture, replay_logs
from lightning_mgpu.strategies.split.merge_metrics import PartMetrics

__all__ = ["ReplicaResult", "ReplicaStep"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaResult:
    """What one replicated step gives back."""

    output: Any
    """The step's output combined over the replicas, on the first device."""
    sizes: list[int]
    """Rows per replica (``[0]``: one replica ran a batch without a batch dimension)."""
    saved_bytes: list[int]
    """Bytes each replica saved for backward, when tracked; else empty."""


class ReplicaStep:
    """Runs steps over replicas; keeps the replicas' metric copies and threads from step to step."""

    def __init__(self) -> None:
        self._metrics = PartMetrics()
        self._threads: ReplicaThreads | None = None
        self._warned_uneven = False
        self._checked_compiled = False

    def chunk_sizes(self, batch: Any, devices: int) -> list[int]:
        """Rows of ``batch`` per replica, over at most ``devices`` replicas; ``[0]``: one replica, whole."""
        rows = split_rows(batch, "mgpu_dp")
        if rows is None:
            log.debug("the batch holds no tensor with a batch dimension: one replica runs it whole")
            return [0]
        sizes = split_sizes(rows, devices)
        log.debug(
            "batch of %s split over %d of %s as %s",
            counted(rows, "row"),
            len(sizes),
            counted(devices, "device"),
            sizes,
        )
        if len(set(sizes)) > 1 and not self._warned_uneven:
            self._warned_uneven = True
            rank_zero_warn(
                f"mgpu_dp split a batch of {rows} rows unevenly over {len(sizes)} devices as {sizes}."
                " Results stay exact (each replica's loss is weighted by its share) but the largest chunk"
                f" sets the pace; a batch size divisible by {devices} (or"
                " `drop_last=True`) keeps the devices balanced."
                " This warning is shown once."
            )
        return sizes

    def run(
        self,
        module: LightningModule,
        method: str,
        step_context: Callable[[], AbstractContextManager[Any]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        all_devices: list[torch.device],
        track_memory: bool,
    ) -> ReplicaResult:
        """``module``'s ``method`` over ``args[0]`` cut into one chunk per replica, made one again."""
        sizes = self.chunk_sizes(args[0], len(all_devices)) if args else [0]
        if len(sizes) == 1:
            call = ReplicaCall(module, method, step_context, track_memory)
            output = call(*args, **kwargs)
            return ReplicaResult(output, sizes, [call.saved_bytes] if track_memory else [])

        devices = all_devices[: len(sizes)]
        if not self._checked_compiled:
            self._checked_compiled = True
            self._warn_compiled(module)
        chunks = scatter_batch(args[0], sizes, devices, "mgpu_dp", module)
        replicas = replicate(module, devices)
        self._metrics.begin(module)
        manual = method == "training_step" and not module.automatic_optimization
        lockstep = Lockstep(len(sizes))  # manual optimization and global_mean meet there
        # replicas on one device share the module's parameters; elsewhere they hold copies
        copies = len(set(devices)) > 1
        log.debug(
            "%s on %d replicas (%s), %s",
            method,
            len(sizes),
            "parameter copies per device" if copies else "sharing the module's parameters on one device",
            "manual optimization in lockstep" if manual else "automatic optimization",
        )
        after_step = (
            functools.partial(refresh_parameters, module, replicas) if manual and copies else lambda: None
        )
        captures = [LogCapture() for _ in sizes]
        calls = []
        for index, (replica, device, capture) in enumerate(zip(replicas, devices, captures, strict=True)):
            hooks: dict[str, Callable[..., Any]] = {"log": capture.log}
            if manual:
                hooks.update(manual_optimization_hooks(module, lockstep, index, sizes, after_step))
            prepare_replica(replica, device, hooks)
            self._metrics.put(replica, index, device)
            on_exit = functools.partial(lockstep.exit, index)
            context = replica_step_context(step_context, index, sizes, lockstep.run)
            calls.append(ReplicaCall(replica, method, context, track_memory, on_exit))

        if self._threads is None:
            self._threads = ReplicaThreads(len(all_devices))
        outputs = self._threads.run(
            calls, [(chunk, *args[1:]) for chunk in chunks], kwargs, devices, lockstep
        )

        originals = self._metrics.merge()
        replay_logs(module, captures, sizes, devices[0], originals)
        saved = [call.saved_bytes for call in calls] if track_memory else []
        return ReplicaResult(combine_outputs(outputs, sizes, devices[0]), sizes, saved)

    @staticmethod
    def _warn_compiled(module: torch.nn.Module) -> None:
        names = compiled_submodules(module)
        if names:
            rank_zero_warn(
                f"mgpu_dp runs the submodules compiled with torch.compile ({', '.join(names)}) uncompiled"
                " in its replicas: compiled code belongs to the module object it was compiled for, and"
                " replicas are new objects every step. Results are unchanged; to train with the compiled"
                " code use `strategy='mgpu_ddp'` (one process per device). This warning is shown once."
            )

    def close(self) -> None:
        """Stop the replicas' threads and drop the metric copies (the run ended)."""
        if self._threads is not None:
            self._threads.close()
            self._threads = None
        self._metrics.clear()
