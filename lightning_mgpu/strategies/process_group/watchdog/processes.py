"""Small process facts the watchdog needs: is a pid alive, how did it end, where is the main thread.

- ``describe_exit(returncode)`` turns a ``Popen.returncode`` into words ("was killed by
  signal 9 (SIGKILL)", "exited with code 3").
- ``pid_status(pid, start_time)`` says whether a process on this machine still runs and,
  while it is a zombie, how it ended (``/proc/<pid>/stat`` field 52 on Linux).
- ``DeadManSwitch`` ends the process from C (``faulthandler``) when nobody re-arms it in
  time, for when no Python thread can run any more.
- ``main_thread_stack()`` and ``main_thread_waits()`` look at the main thread from another
  thread: its stack, and whether it sits in a collective (``torch.distributed``, DDP's
  gradient all-reduce inside ``backward``, Lightning's per-step broadcast).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from types import FrameType

import psutil

__all__ = [
    "DeadManSwitch",
    "PidStatus",
    "describe_exit",
    "main_thread_stack",
    "main_thread_waits",
    "pid_status",
    "start_time",
    "stat_fields",
]

# innermost frames that mean "blocked until the other ranks arrive"
_WAITING_PATHS = ("torch/distributed/", "torch/nn/parallel/distributed.py", "torch/autograd/")
# Lightning waits here on the result of its per-step broadcast (NCCL returns before it completes)
_WAITING_FUNCTIONS = ("_broadcast_sigterm_tensor",)


def describe_exit(returncode: int | None) -> str:
    """``Popen.returncode`` in words: a negative code is the signal that ended the process."""
    if returncode is None:
        return "ended (its exit status was already collected by its parent)"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown signal"
        return f"was killed by signal {-returncode} ({name})"
    return f"exited with code {returncode}"


@dataclass(frozen=True)
class PidStatus:
    """What ``/proc`` says about a process."""

    alive: bool
    returncode: int | None = None
    """``Popen``-style code (negative: signal) while the process is a zombie; ``None`` when unknown."""


def stat_fields(path: str) -> list[str] | None:
    """The fields of a ``/proc/<pid>/stat`` (or ``/proc/self/task/<tid>/stat``) from the state on, ``None``
    when it cannot be read (the process ended, not Linux)."""
    try:
        with open(path) as f:
            stat = f.read()
    except OSError:
        return None
    # the command name may contain spaces and parentheses; the fields follow the last ")"
    _, closing, fields = stat.rpartition(")")
    return fields.split() if closing else None  # an empty read: the process ended meanwhile


def start_time(pid: int) -> str | None:
    """The process start time in clock ticks (``/proc/<pid>/stat`` field 22), to tell a reused pid apart."""
    fields = stat_fields(f"/proc/{pid}/stat")
    return fields[19] if fields is not None and len(fields) > 19 else None


def pid_status(pid: int, started: str | None = None) -> PidStatus:
    """Whether ``pid`` still runs on this machine; how it ended while it is a zombie.

    ``started`` is the start time seen earlier: a process with another start time is a
    new one that reused the pid, so the one we knew is gone.
    """
    fields = stat_fields(f"/proc/{pid}/stat")
    if fields is None:  # ended, or not Linux
        return PidStatus(alive=sys.platform != "linux" and psutil.pid_exists(pid))
    if started is not None and len(fields) > 19 and fields[19] != started:
        return PidStatus(alive=False)
    if fields[0] not in ("Z", "X"):
        return PidStatus(alive=True)
    # field 52: the exit status in waitpid(2) form (Linux >= 3.5)
    if len(fields) > 49 and fields[49].isdigit():
        status = int(fields[49])
        if os.WIFSIGNALED(status):
            return PidStatus(alive=False, returncode=-os.WTERMSIG(status))
        return PidStatus(alive=False, returncode=os.WEXITSTATUS(status))
    return PidStatus(alive=False)


def _main_frame() -> FrameType | None:
    ident = threading.main_thread().ident
    return sys._current_frames().get(ident) if ident is not None else None


def main_thread_stack() -> str:
    """The main thread's Python stack, innermost call last, as ``traceback`` prints it."""
    frame = _main_frame()
    if frame is None:
        return "  (the main thread has no Python frame)\n"
    return "".join(traceback.format_stack(frame))


def main_thread_waits() -> bool:
    """Whether the main thread is blocked in a collective rather than in its own work."""
    frame = _main_frame()
    if frame is None:
        return False
    path = frame.f_code.co_filename.replace(os.sep, "/")
    return any(p in path for p in _WAITING_PATHS) or frame.f_code.co_name in _WAITING_FUNCTIONS


class DeadManSwitch:
    """``faulthandler``'s timer: dumps every thread's stack and ends the process, GIL or not."""

    def __init__(self) -> None:
        self._armed_at: float | None = None

    def arm(self, timeout: float, now: float, force: bool = False) -> None:
        """(Re-)start the timer; re-arming starts a thread, so only every ``timeout / 6`` s."""
        if not force and self._armed_at is not None and now - self._armed_at < timeout / 6:
            return
        with contextlib.suppress(Exception):  # no usable stderr file descriptor
            faulthandler.dump_traceback_later(timeout, exit=True)
            self._armed_at = now

    def disarm(self) -> None:
        if self._armed_at is not None:
            faulthandler.cancel_dump_traceback_later()
            self._armed_at = None
