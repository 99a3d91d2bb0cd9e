"""The process group destroyed before the interpreter exits, so that a finished run exits 0.

Lightning destroys the default process group at exit only for NCCL. A gloo group left alive is
torn down with the interpreter, after Python's own shutdown, where a backend thread still running
ends the process with "terminate called without an active exception" (SIGABRT) after the last
step, and torchrun reports the job as failed. :func:`destroy_at_exit` registers, once per
process, an ``atexit`` handler that destroys the group while the interpreter is whole.

Registered before the watchdog joins the run (``Watchdog.attach``), it runs after the watchdog's
own exit guard, which bounds a destroy that hangs on a lost peer after a failed run.
"""

from __future__ import annotations

import atexit
import logging

from lightning.fabric.utilities.distributed import _destroy_dist_connection

__all__ = ["destroy_at_exit"]

log = logging.getLogger(__name__)

_REGISTERED = False


def destroy_at_exit() -> None:
    """Destroy the default process group (if one exists then) when the interpreter exits; once."""
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True
    atexit.register(_destroy_dist_connection)
    log.debug("the process group is destroyed at exit")
