"""How a rank's process ends once the run must stop, and how the launching process ends after a clean run.

- ``stop_process``: prints the reason in one line (when a rank failed by itself, the line the
  main thread prints when its collective fails first) and a stuck rank's Python stack, counts
  this rank among those that know why the run ends, gives the other ranks (on rank 0: to read
  it) and the child processes a moment to end, kills the children still running and ends the
  process with ``os._exit``;
- ``wait_until_settled``: rank 0 leaves, a bounded while, only once every other live rank has read
  why the run ends (``Heartbeats.unsettled``);
- ``wait_for_children``: at exit of the launching process after a clean run, waits for the
  ranks it started and ends with an error if one of them failed;
- ``kill_children``: stops the child processes still running;
- ``ExitSummary``: when a failed run's exception ends the process uncaught, each rank prints
  one line that names the failed rank and the cause, and only the rank that failed first
  prints its traceback: the run shows one traceback, not one per rank.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import NoReturn

from lightning_mgpu.strategies.process_group.watchdog import processes
from lightning_mgpu.strategies.process_group.watchdog.heartbeats import Heartbeats
from lightning_mgpu.strategies.process_group.watchdog.verdicts import Verdict

__all__ = [
    "ExitSummary",
    "kill_children",
    "stop_process",
    "wait_for_children",
    "wait_until_settled",
]

log = logging.getLogger(__name__)


def kill_children(children: Iterable[subprocess.Popen], wait: float | None = None) -> None:
    """SIGKILL every child still running; with ``wait``, collect each for up to ``wait`` seconds."""
    for proc in children:
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                proc.kill()
            if wait is not None:
                with contextlib.suppress(Exception):
                    proc.wait(timeout=wait)


def stop_process(
    rank: int,
    verdict: Verdict,
    stuck: bool,
    run: Heartbeats | None,
    children: Mapping[int, subprocess.Popen],
    exit_code: int,
    grace: float,
) -> NoReturn:
    """Say why this rank stops, wait up to ``grace`` s for the others to read it, then end the process."""
    out = sys.stderr
    if verdict.origin >= 0:
        # the line the main thread prints when its collective fails first, with the "[rank<N>]: "
        # torch's excepthook puts in front of an uncaught exception's lines
        out.write(f"[rank{rank}]: {verdict.stopped(rank)}\n")
    else:
        stopping = f"stopping this process (pid {os.getpid()}) so the run does not hang"
        out.write(f"[rank {rank}] lightning_mgpu: {verdict.message}; {stopping}\n")
    if stuck:
        out.write(f"[rank {rank}] this rank is stuck here (main thread, innermost call last):\n")
        out.write(processes.main_thread_stack())
    out.flush()
    deadline = time.monotonic() + grace
    if run is not None:
        run.settle()
        if rank == 0:
            wait_until_settled(run, verdict, children, grace)
    while any(p.poll() is None for p in children.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    kill_children(children.values(), wait=5)
    log.debug("rank %d: ending the process with exit code %d", rank, exit_code)
    os._exit(exit_code)


def wait_until_settled(
    run: Heartbeats, verdict: Verdict | None, children: Mapping[int, subprocess.Popen], limit: float
) -> list[int]:
    """Keep rank 0's process until the other ranks settled, at most ``limit`` s; the ranks that did not.

    Rank 0's process holds the run's store (Lightning's launcher, SLURM), or its end makes torchrun stop
    the other ranks. A rank whose watchdog had not yet read there the verdict, or that rank 0 finished
    the run, could then only report a lost store, or a SIGTERM.
    """
    deadline = time.monotonic() + limit
    while (waiting := run.unsettled(verdict, children)) and time.monotonic() < deadline:
        time.sleep(0.02)
    if waiting:
        log.debug("rank %d: ranks %s did not read why the run ends within %g s", run.rank, waiting, limit)
    return waiting


def wait_for_children(rank: int, children: Mapping[int, subprocess.Popen], tell_after: float) -> None:
    """At exit of the launching process after a clean run: end with an error if a rank it started failed.

    Lightning's launcher lets this process end while the ranks it started still run, so a
    rank that fails after the last collective (or that was left behind in one) would leave
    the command's exit status 0. After a failed run the watchdog stops the ranks itself.
    """
    # Lightning ignores Ctrl+C while it destroys the process group; a wait must stay interruptible
    with contextlib.suppress(ValueError):  # not the main thread
        signal.signal(signal.SIGINT, signal.default_int_handler)
    failed: list[str] = []
    told = False
    started = time.monotonic()
    try:
        for child_rank, proc in children.items():
            while proc.poll() is None:
                if not told and time.monotonic() - started >= tell_after:
                    told = True
                    sys.stderr.write(
                        f"[rank {rank}] lightning_mgpu: this rank finished; waiting for rank {child_rank}"
                        f" (pid {proc.pid}) to end\n"
                    )
                time.sleep(0.1)
            if proc.returncode:
                how = processes.describe_exit(proc.returncode)
                failed.append(f"rank {child_rank} (pid {proc.pid}) {how}")
    except KeyboardInterrupt:
        kill_children(children.values())
        failed.append("interrupted while waiting for the other ranks to end")
    if failed:
        reasons = "; ".join(failed)
        sys.stderr.write(f"[rank {rank}] lightning_mgpu: the run failed after this rank ended: {reasons}\n")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


class ExitSummary:
    """What this rank prints if the exception of a failed run ends the process (``sys.excepthook``).

    Only that very exception is affected: any other uncaught exception, and one the user's
    code catches, is left alone.

    Args:
        claim: asked before printing: ``False`` when the watchdog already stops this process
            and has said why, so that the rank prints one line, not two.
    """

    def __init__(self, claim: Callable[[], bool] = lambda: True) -> None:
        self._claim = claim
        self._exception: BaseException | None = None
        self._line = ""
        self._traceback = True
        self._previous: object = None

    def install(self) -> None:
        """Chain in front of ``sys.excepthook`` once (from the main thread, so not from a spawned helper)."""
        if self._previous is not None or threading.current_thread() is not threading.main_thread():
            return
        self._previous = sys.excepthook
        sys.excepthook = self._hook

    def set(self, exception: BaseException, line: str, traceback: bool) -> None:
        """Print ``line`` instead of the traceback of ``exception`` (before it, with ``traceback=True``)."""
        self._exception, self._line, self._traceback = exception, line, traceback

    def _hook(self, kind: type[BaseException], exception: BaseException, tb: TracebackType | None) -> None:
        previous = self._previous if callable(self._previous) else sys.__excepthook__
        if exception is not self._exception:
            previous(kind, exception, tb)
            return
        if not self._claim():
            return  # the watchdog ends this process and has said why
        sys.stderr.write(f"{self._line}\n")
        sys.stderr.flush()
        if self._traceback:
            previous(kind, exception, tb)
