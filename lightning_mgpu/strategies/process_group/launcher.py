"""Lightning's subprocess launcher with the watchdog in place of its child-process observer.

Lightning's observer polls every 5 s and answers a dead child by SIGKILLing every process,
the launching one included, without saying which rank died or why. The watchdog polls
every second, names the rank and its exit code or signal, and gives the other ranks a
moment to print the reason before they stop.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from lightning_mgpu._compat.lightning import SubprocessScriptLauncher, set_num_threads_if_needed
from lightning_mgpu.strategies.process_group.watchdog.local_checks import PARENT_PID_ENV
from lightning_mgpu.strategies.process_group.watchdog.watchdog import watchdog

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)


class _WatchedSubprocessScriptLauncher(SubprocessScriptLauncher):
    """Starts one process per extra local device like Lightning does, then watches them."""

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            # the children learn which process launched them, to notice when it dies
            os.environ[PARENT_PID_ENV] = str(os.getpid())
            try:
                self._call_children_scripts()
            finally:
                del os.environ[PARENT_PID_ENV]
            first = self.cluster_environment.node_rank() * self.num_processes
            ranks = [first + local_rank for local_rank in range(1, self.num_processes)]
            log.debug("rank %d started ranks %s (pids %s)", first, ranks, [proc.pid for proc in self.procs])
            watchdog().watch_children(self.procs, ranks, own_rank=first)
        else:
            log.debug("the processes were started by %s", type(self.cluster_environment).__name__)
        set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)
