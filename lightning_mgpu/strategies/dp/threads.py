"""Run the replicas' step calls at the same time: ``torch.nn.parallel.parallel_apply`` on GPUs, a pool on CPU.

- On CUDA devices torch's ``parallel_apply`` runs one thread per replica, each on its device's stream.
- On CPU (and other devices) a pool of ``devices - 1`` threads runs every replica but the first,
  which runs in the calling thread. The replicas share the cores: with OpenMP each runs its ops
  with ``torch.get_num_threads() // replicas`` intra-op threads instead of oversubscribing.

Either way, a replica's exception is recorded by its ``ReplicaCall`` and the one that matters
(the first that is not another replica stopping because of it) is raised once all have finished.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import torch

from lightning_mgpu.strategies.dp.lockstep import Lockstep
from lightning_mgpu.strategies.dp.replicas import ReplicaCall

__all__ = ["ReplicaThreads"]

log = logging.getLogger(__name__)

# other backends warn when the thread count changes after parallel work started
_OPENMP = "parallel backend: OpenMP" in torch.__config__.parallel_info()


class ReplicaThreads:
    """Runs one step call per replica in parallel; keeps its CPU thread pool between steps.

    Args:
        size: the most replicas a step runs (the number of devices).

    Example::

        threads = ReplicaThreads(2)
        outputs = threads.run(calls, inputs, {}, devices, lockstep)
        threads.close()
    """

    def __init__(self, size: int) -> None:
        self._size = size
        self._pool: ThreadPoolExecutor | None = None

    def run(
        self,
        calls: list[ReplicaCall],
        inputs: list[tuple[Any, ...]],
        kwargs: dict[str, Any],
        devices: Sequence[torch.device],
        lockstep: Lockstep,
    ) -> list[Any]:
        """Each ``calls[i](*inputs[i], **kwargs)`` on ``devices[i]``; their results in replica order.

        Raises:
            BaseException: the first replica's own error (see ``Lockstep.raise_first``).
        """
        if devices[0].type == "cuda":
            from torch.nn.parallel import parallel_apply

            try:
                return parallel_apply(calls, inputs, [kwargs] * len(calls), list(devices))  # type: ignore[arg-type]
            except Exception:
                lockstep.raise_first()
                raise
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=max(1, self._size - 1), thread_name_prefix="mgpu_dp")
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

    def close(self) -> None:
        """Stop the pool's threads (a later ``run`` starts a new pool)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
