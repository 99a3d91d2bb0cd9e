"""See SIGTERM and SIGINT from a thread, even while the main thread is blocked in C++.

A Python signal handler only runs when the main thread executes Python code, so it never
runs while that thread waits in a collective. The interpreter's C-level handler, however,
writes the signal number to the file descriptor given to ``signal.set_wakeup_fd`` at
once. ``SignalPipe`` owns that descriptor; another thread waits on it with ``select``.
Bytes meant for a wakeup descriptor that was set before (asyncio's, say) are passed on.

The C-level handler exists only for signals that have a Python handler; Lightning installs
one for SIGTERM during ``fit``, and Python has one for SIGINT.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
from dataclasses import dataclass

__all__ = ["SignalPipe", "quiet_sigterm"]

_WATCHED = (signal.SIGTERM, signal.SIGINT)


@dataclass(frozen=True)
class _Pipe:
    read: int
    write: int
    """The interpreter's wakeup descriptor while installed."""
    previous: int
    """The wakeup descriptor set before (-1: none), given back by ``restore``."""


class SignalPipe:
    """A wakeup descriptor for the interpreter's signal handler, read by another thread."""

    def __init__(self) -> None:
        self._fds: _Pipe | None = None

    def install(self) -> None:
        """Take over the wakeup descriptor; a no-op outside the main thread or when installed."""
        if self._fds is not None or threading.current_thread() is not threading.main_thread():
            return
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)
        try:
            previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except ValueError:
            os.close(read_fd)
            os.close(write_fd)
            return
        self._fds = _Pipe(read_fd, write_fd, previous)

    def restore(self) -> None:
        """Give the wakeup descriptor back (main thread only)."""
        if self._fds is None or threading.current_thread() is not threading.main_thread():
            return
        fds, self._fds = self._fds, None
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(fds.previous)
        os.close(fds.read)
        os.close(fds.write)

    def wake(self) -> None:
        """Make a pending :meth:`wait` return now."""
        fds = self._fds
        if fds is not None:
            with contextlib.suppress(OSError):
                os.write(fds.write, b"\0")

    def wait(self, timeout: float, stop: threading.Event) -> int | None:
        """Wait up to ``timeout`` s; return SIGTERM or SIGINT if one arrived meanwhile."""
        fds = self._fds
        if fds is None:
            stop.wait(timeout)
            return None
        try:
            ready, _, _ = select.select([fds.read], [], [], timeout)
            data = os.read(fds.read, 512) if ready else b""
        except OSError:  # restore() closed the pipe meanwhile
            return None
        data = data.replace(b"\0", b"")  # wake() bytes are ours
        if data and fds.previous != -1:
            with contextlib.suppress(OSError):
                os.write(fds.previous, data)
        return next((signum for signum in data if signum in _WATCHED), None)


def quiet_sigterm() -> None:
    """Put a handler that does nothing in place of the SIGTERM handler (from the main thread only).

    For a failing run: Lightning's handler broadcasts a tensor, which with a lost peer only fails or
    hangs; the watchdog still sees the signal and ends the process if it does not end by itself.
    A Python-level handler must stay, so that the interpreter still writes the signal to the
    wakeup descriptor that ``SignalPipe`` reads.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _note_signal)


def _note_signal(signum: int, frame: object) -> None:
    """Nothing to do: the watchdog thread sees the signal through the wakeup descriptor."""
