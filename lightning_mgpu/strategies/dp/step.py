"""One step of ``mgpu_dp``: the batch cut per replica, the replicas run in threads, the results made one.

``ReplicaStep.run`` serves ``training_step``, ``validation_step``, ``test_step`` and ``predict_step``
alike: it replicates the module on each device, gives each replica its chunk, its own copies of the
module's metrics and a ``self.log`` that records, runs them at once, then merges the metrics, replays
the logs once and combines the outputs on the first device.

The replicas' step calls run at the same time:

- on CUDA devices torch's ``parallel_apply`` runs one thread per replica, each on its device's stream;
- on CPU (and other devices) a pool of ``devices - 1`` threads, kept from step to step, runs every
  replica but the first, which runs in the calling thread. The replicas share the cores: with OpenMP
  each runs its ops with ``torch.get_num_threads() // replicas`` intra-op threads instead of
  oversubscribing.

Either way, a replica's exception is recorded by its ``ReplicaCall`` and the one that matters
(the first that is not another replica stopping because of it) is raised once all have finished.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn.parallel import parallel_apply

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
from lightning_mgpu.strategies.split.batch import combine_outputs, scatter_batch, split_rows, split_sizes
from lightning_mgpu.strategies.split.logs import LogCapture, replay_logs
from lightning_mgpu.strategies.split.merge_metrics import PartMetrics

__all__ = ["ReplicaResult", "ReplicaStep"]

log = logging.getLogger(__name__)

# other backends warn when the thread count changes after parallel work started
_OPENMP = "parallel backend: OpenMP" in torch.__config__.parallel_info()


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
    """Runs steps over replicas; keeps the replicas' metric copies and CPU threads from step to step."""

    def __init__(self) -> None:
        self._metrics = PartMetrics()
        self._pool: ThreadPoolExecutor | None = None
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

        inputs = [(chunk, *args[1:]) for chunk in chunks]
        outputs = self._run_at_once(calls, inputs, kwargs, devices, len(all_devices), lockstep)

        originals = self._metrics.merge()
        replay_logs(module, captures, sizes, devices[0], originals)
        saved = [call.saved_bytes for call in calls] if track_memory else []
        return ReplicaResult(combine_outputs(outputs, sizes, devices[0]), sizes, saved)

    def _run_at_once(
        self,
        calls: list[ReplicaCall],
        inputs: list[tuple[Any, ...]],
        kwargs: dict[str, Any],
        devices: Sequence[torch.device],
        pool_size: int,
        lockstep: Lockstep,
    ) -> list[Any]:
        """Each ``calls[i](*inputs[i], **kwargs)`` on ``devices[i]``, at once; results in replica order.

        Raises:
            BaseException: the first replica's own error (see ``Lockstep.raise_first``).
        """
        if devices[0].type == "cuda":
            try:
                return parallel_apply(calls, inputs, [kwargs] * len(calls), list(devices))  # type: ignore[arg-type]
            except Exception:
                lockstep.raise_first()
                raise
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=max(1, pool_size - 1), thread_name_prefix="mgpu_dp")
        # with OpenMP a thread takes the process-wide setting when it first runs a parallel op
        threads = torch.get_num_threads()
        if _OPENMP:
            log.debug(
                "%d CPU replicas share %d intra-op threads: %d each",
                len(calls),
                threads,
                threads // len(calls),
            )
            torch.set_num_threads(max(1, threads // len(calls)))
        try:
            futures = [
                self._pool.submit(call, *inp, **kwargs)
                for call, inp in zip(calls[1:], inputs[1:], strict=True)
            ]
            # a replica's exception is recorded in `lockstep`: wait for all, then raise the one that matters
            first = None
            with contextlib.suppress(Exception):
                first = calls[0](*inputs[0], **kwargs)
            wait(futures)
        finally:
            if _OPENMP:
                torch.set_num_threads(threads)
        lockstep.raise_first()
        return [first, *(future.result() for future in futures)]

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
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        self._metrics.clear()
