"""The process group destroyed before the interpreter exits, so that a finished run exits 0.

Lightning destroys the default process group at exit only for NCCL. A gloo group left alive is
torn down with the interpreter, after Python's own shutdown, where a backend thread still running
ends the process with "terminate called without an active exception" (SIGABRT) after the last
step, and torchrun reports the job as failed. :func:`destroy_at_exit` registers, once per
process, an ``atexit`` handler that destroys the group while the interpreter is whole
(pytorch/pytorch#190489, torch 2.6 to 2.13; the fix in torch, pytorch/pytorch#179291, was abandoned).

Destroying the group does not stop gloo's worker threads (the group lives on in the objects that
hold it, FSDP's device mesh say), and a worker releases the last reference to a collective it ran
only after that collective woke its caller. When the collective's tensors are Python's (an all-gather
of ``DTensor.full_tensor``, say), that release takes the GIL: during the interpreter's shutdown it
ends the thread, and the unwinding aborts the process, the same message, seen in a core dump. So the
handler then lets the other threads run while the interpreter is whole (:func:`_let_threads_settle`:
until none is runnable, at most :data:`SETTLE_SECONDS`).

Registered before the watchdog joins the run (``Watchdog.attach``), it runs after the watchdog's
own exit guard, which bounds a destroy that hangs on a lost peer after a failed run and stops the
watchdog's thread first: a store call of that thread failing once the group (and with it rank 0's
store) is gone would abort the process the same way.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
import time

from lightning_mgpu._compat.lightning import destroy_dist_connection
from lightning_mgpu.strategies.process_group.watchdog.processes import stat_fields

__all__ = ["SETTLE_SECONDS", "destroy_at_exit"]

log = logging.getLogger(__name__)

SETTLE_SECONDS = 0.5
"""The longest the exit waits for other threads to stop running (they take milliseconds when idle)."""


def _runnable_threads() -> int:
    """How many threads of this process, the calling one aside, are running or ready to run (Linux)."""
    try:
        tasks = [task for task in os.listdir("/proc/self/task") if int(task) != threading.get_native_id()]
    except OSError:
        return 0
    states = [stat_fields(f"/proc/self/task/{task}/stat") for task in tasks]  # None: the thread ended
    return sum(1 for fields in states if fields and fields[0] == "R")


def _let_threads_settle(limit: float = SETTLE_SECONDS) -> None:
    """Sleep, the GIL released, until no other thread is runnable twice in a row, or ``limit`` passed."""
    deadline = time.monotonic() + limit
    quiet = 0
    while quiet < 2 and time.monotonic() < deadline:
        time.sleep(0.002)
        quiet = quiet + 1 if _runnable_threads() == 0 else 0


def _destroy_then_settle() -> None:
    destroy_dist_connection()
    _let_threads_settle()


@functools.cache  # registered once per process
def destroy_at_exit() -> None:
    """Destroy the default process group (if one exists then) when the interpreter exits, then let
    the threads that still hold Python objects release them; once."""
    atexit.register(_destroy_then_settle)
    log.debug("the process group is destroyed at exit")
