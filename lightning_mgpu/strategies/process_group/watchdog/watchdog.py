"""One watchdog thread per rank, so that a multi-process run never dies silently or hangs.

A collective blocks the main thread inside C++, where neither Python signal handlers nor
exceptions reach it. The watchdog is a daemon thread that, once a second and off the
training path:

- polls the launcher's child processes (exact exit code or signal from ``Popen``);
- checks the launching process, for ranks that Lightning's launcher started, and the
  other ranks that run on this machine (``/proc``);
- notices SIGTERM and SIGINT through ``signal.set_wakeup_fd``, which the interpreter
  writes to even while the main thread is blocked;
- writes a heartbeat (progress counter, idle seconds, whether the main thread waits in
  a collective) to the run's TCPStore through a client of its own; rank 0 reads them all
  and decides when a rank stopped beating or the run stalled for ``stall_timeout``;
- reads the ``abort`` key, where the first rank that found a problem wrote it.

Once a reason to stop exists, the main thread gets ``GRACE`` seconds to end by itself
(it usually gets an error from its collective, which the strategy explains with the
reason). After that the watchdog prints the reason, lets the other ranks read it, stops
the child processes and ends the process with ``os._exit``. A stuck rank prints its
Python stack and ends at once.

One way out per failed run: the first to begin (the main thread's exit or the watchdog's stop)
takes it, the other stays silent. The main thread's way stops this thread before rank 0's store
goes with the process group: a store call failing while the interpreter shuts down aborts the
process ("terminate called without an active exception", exit 134). Either way, and after a
finished run too, rank 0 (whose process holds the store, or whose end makes torchrun stop the
others) leaves once the other ranks have read why the run ends (a bounded wait), or they could
only report a lost store.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from lightning_mgpu.strategies.process_group.errors import add_to_message, is_communication_error
from lightning_mgpu.strategies.process_group.watchdog import processes, shutdown
from lightning_mgpu.strategies.process_group.watchdog.heartbeats import Heartbeats, Idleness
from lightning_mgpu.strategies.process_group.watchdog.local_checks import LocalChecks
from lightning_mgpu.strategies.process_group.watchdog.signals import SignalPipe, quiet_sigterm
from lightning_mgpu.strategies.process_group.watchdog.verdicts import (
    Beat,
    RankInfo,
    Suspect,
    Verdict,
    finished_early,
    left_behind,
)

__all__ = ["GRACE", "INTERVAL", "Verdict", "Watchdog", "watchdog"]

log = logging.getLogger(__name__)

INTERVAL = 1.0
"""Seconds between two checks (and two heartbeats)."""
GRACE = 3.0
"""Seconds the main thread gets to end by itself once the run must stop."""
DEAD_AFTER = 10.0
"""Seconds without a heartbeat after which a rank counts as gone."""


class Watchdog:
    """The per-process watchdog; get it with :func:`watchdog`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._verdict_event = threading.Event()
        self.rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
        self._local = LocalChecks()
        self._run: Heartbeats | None = None
        self._last_run: Heartbeats | None = None  # kept after detach: the store outlives the run
        self._verdict: Verdict | None = None
        self._verdict_at = 0.0
        self._suspect: Suspect | None = None
        self._exit_code = 1
        self._idleness = Idleness(wait_after=2 * INTERVAL, changed=time.monotonic())
        self._signals = SignalPipe()
        self._exit_owner: str | None = None  # "main" or "watchdog", once a failed run ends
        self._exit_summary = shutdown.ExitSummary(claim=lambda: self._claim_exit("main"))
        self._dead_man = processes.DeadManSwitch()
        self._done_peers: list[int] = []  # the other ranks that said they finished the run
        self._ended_cleanly = False

    # ----------------------------------------------------------------- set-up
    def watch_children(self, procs: list[subprocess.Popen], ranks: list[int], own_rank: int) -> None:
        """Watch the ranks this process launched (call right after starting them; none: nothing to do)."""
        self.rank = own_rank
        self._local.children = dict(zip(ranks, procs, strict=True))
        if not procs:
            return  # one process per node: its run starts and stops the thread
        atexit.unregister(self._wait_for_children)  # once per process
        atexit.register(self._wait_for_children)
        self._start_thread()

    def start(self, rank: int, local_rank: int) -> None:
        """Start watching as ``rank``; call from the main thread before the process group exists."""
        self.rank = rank
        self._done_peers = []  # an earlier run's
        if self._verdict is not None and self._verdict.origin == rank:
            self._verdict = None  # an earlier run's own error, which the user caught
            self._verdict_event.clear()
        self._decide(self._local.find_parent(rank, local_rank))
        self._signals.install()
        self._exit_summary.install()
        self._start_thread()

    def attach(
        self,
        store: Any,
        world_size: int,
        info: RankInfo,
        progress: Callable[[], int],
        stall_timeout: float | None,
    ) -> None:
        """Join the run's heartbeat exchange through ``store`` (after the process group exists)."""
        run = Heartbeats(store, self.rank, world_size, progress, stall_timeout, DEAD_AFTER)
        run.introduce(info)
        # once per process, registered after the process group, so it runs before the atexit handler
        # that destroys the group, which with NCCL can hang on a lost peer
        atexit.unregister(self._bound_exit)
        atexit.register(self._bound_exit)
        self._idleness.reset(time.monotonic())
        self._ended_cleanly, self._done_peers = False, []
        with self._lock:
            self._run = self._last_run = run
        self._beat(run, time.monotonic())

    def infos(self, timeout: float = 30.0) -> dict[int, RankInfo]:
        """Every rank's :class:`RankInfo`, waiting up to ``timeout`` seconds for late ones."""
        run = self._run
        return run.wait_for_infos(timeout) if run is not None else {}

    def detach(self) -> None:
        """The run ended on this rank: say so, stop beating, give SIGTERM back to Lightning."""
        with self._lock:
            run, self._run = self._run, None
        if run is not None:
            with contextlib.suppress(Exception):
                run.beat(self._idleness.last or 0, 0.0, waiting=False, done=True)
            run.settle()
        self._dead_man.disarm()
        self._ended_cleanly = run is not None and self._verdict is None
        if self._verdict is None or self._verdict.origin == self.rank:
            self._stop_thread()
        self._signals.restore()

    # ------------------------------------------------------------- verdicts
    @property
    def verdict(self) -> Verdict | None:
        return self._verdict

    def wait_for_verdict(self, timeout: float) -> Verdict | None:
        """The reason the run stops, waiting up to ``timeout`` s; a suspicion counts at once."""
        deadline = time.monotonic() + timeout
        while self._verdict is None and self._thread is not None and time.monotonic() < deadline:
            suspect, done = self._suspect, self._done_peers
            if suspect is not None:
                self._decide(suspect.verdict())
            elif done:
                self._decide(Verdict(finished_early(done), dead=tuple(done)))
            else:
                self._signals.wake()  # check now rather than at the next tick
                self._verdict_event.wait(0.2)
        return self._verdict

    def explain_failure(self, exception: BaseException) -> None:
        """The run failed on this rank with ``exception``: a peer's failure named in its message, this rank's
        own told to the others (this process still ends its own way); should it end the process, one line
        names the rank that failed first and the cause, and only that rank prints its traceback."""
        rank = self.rank
        quiet_sigterm()
        if is_communication_error(exception):
            # a peer went away: wait for the watchdog to learn which one and how
            verdict = self.wait_for_verdict(DEAD_AFTER + 2 * INTERVAL)
            if verdict is not None and verdict.origin != rank:
                add_to_message(exception, verdict.stopped(rank))
                self._exit_summary.set(exception, verdict.stopped(rank), traceback=verdict.origin < 0)
                return
        first_line = (str(exception).strip().splitlines() or [""])[0]
        error = f"{type(exception).__name__}: {first_line}"
        where = f"pid {os.getpid()} on {socket.gethostname()}"
        own = Verdict(f"rank {rank} ({where}) failed with {error}", origin=rank)
        verdict = self._decide(own) or own
        self._exit_summary.set(exception, *verdict.failed(rank, error))

    def _decide(self, verdict: Verdict | None, publish: bool = True) -> Verdict | None:
        """Make ``verdict`` (if any) the run's, unless it has one: the run's verdict. ``publish``: offer it
        to the others (an earlier one published wins); ``False`` for one read from the store."""
        with self._lock:
            if self._verdict is not None or verdict is None:
                return self._verdict
            self._verdict = verdict
            self._verdict_at = time.monotonic()
            run = self._run
        log.debug("rank %d: the run must stop (published: %s): %s", self.rank, not publish, verdict)
        if run is not None:
            try:
                if publish:
                    self._verdict = run.publish(verdict)
            except Exception:
                self._run = None
            run.settle()
        self._verdict_event.set()
        return self._verdict

    # ---------------------------------------------------------------- thread
    def _start_thread(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lightning-mgpu-watchdog", daemon=True)
        self._thread.start()

    def _stop_thread(self) -> None:
        self._stop.set()
        self._signals.wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * INTERVAL)
        self._thread = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            signum = self._signals.wait(INTERVAL, self._stop)
            if self._stop.is_set():
                break
            try:
                self._tick(time.monotonic(), signum)
            except Exception as err:  # the watchdog itself must never take the run down
                sys.stderr.write(f"[rank {self.rank}] lightning_mgpu watchdog: {err!r}\n")

    def _tick(self, now: float, signum: int | None = None) -> None:
        run = self._run
        if self._verdict is None:
            self._decide(self._local.check_children() or self._check_parent())
        if run is not None:
            self._exchange(run, now)
        elif 0 in self._done_peers and self._verdict is None:
            self._decide(self._left_behind_rank0(now))
        suspect = self._suspect
        if self._verdict is None and suspect is not None and now - suspect.since >= DEAD_AFTER:
            self._decide(suspect.verdict())
        # a signal is the reason only when nothing else is: torchrun, for one, sends SIGTERM
        # to the other ranks because one rank died
        if signum is not None and self._verdict is None:
            self._exit_code = 128 + signum
            name = signal.Signals(signum).name
            self._decide(Verdict(f"rank {self.rank} (pid {os.getpid()}) received {name}"))
        if self._verdict is not None:
            self._enforce(now)

    # ---------------------------------------------------------- local checks
    def _check_parent(self) -> Verdict | None:
        ended = self._local.parent_ended()
        if ended is None:
            return None
        if ended.rank == 0:
            with self._lock:
                self._run = None  # rank 0 held the store: touching it now only prints socket errors
        if ended.returncode:
            return Verdict(ended.message, dead=(ended.rank,))
        if not (ended.rank == 0 and 0 in self._done_peers):
            # ended cleanly: a failed rank 0 may still publish why, so wait before judging
            self._suspect = Suspect(time.monotonic(), f"{ended.message} before the run ended", (ended.rank,))
            log.debug("rank %d: suspect: %s", self.rank, self._suspect.message)
        return None

    # ------------------------------------------------------------ heartbeats
    def _beat(self, run: Heartbeats, now: float) -> None:
        state = self._idleness.look(run.progress(), now)
        run.beat(state.progress, state.idle, waiting=state.waiting)
        if run.stall_timeout is not None:
            # if this thread cannot run (the main thread holds the GIL in C code), the
            # interpreter's C-level timer still dumps every stack and ends the process
            self._dead_man.arm(max(60.0, 2 * run.stall_timeout + DEAD_AFTER), now)

    def _exchange(self, run: Heartbeats, now: float) -> None:
        try:
            self._beat(run, now)
            if self._verdict is None:
                self._decide(run.abort(), publish=False)
            run.read_infos()
            if self._verdict is None:
                self._decide(self._local.check_same_host(run))
            if self._verdict is None:
                self._decide(self._judge(run, now))
        except Exception:
            self._store_lost(run)

    def _judge(self, run: Heartbeats, now: float) -> Verdict | None:
        # the other ranks read their own beat too, to see themselves left behind by rank 0
        beats = run.read_beats(range(run.world_size) if self.rank == 0 else [0, self.rank])
        self._done_peers = [r for r, b in beats.items() if b.done and r != self.rank]
        if 0 in self._done_peers:
            run.settle()  # told why rank 0 leaves: it may now take its store with it
        return run.judge.look(beats, now, run.infos, self._local.child_finished)

    def _left_behind_rank0(self, now: float) -> Verdict | None:
        """Once rank 0 finished the run and its store is gone: is this rank still waiting in a collective?"""
        assert self._last_run is not None  # rank 0's beats came through it
        own = self._idleness.look(self._last_run.progress(), now)
        beats = {0: Beat(0, 0, 0.0, waiting=False, done=True), self.rank: own}
        return left_behind(beats, DEAD_AFTER)

    def _store_lost(self, run: Heartbeats) -> None:
        with self._lock:
            if self._run is run:
                self._run = None
        self._decide(self._check_parent())  # a dead launcher explains a lost store best
        if self._verdict is not None or self._suspect is not None or 0 in self._done_peers:
            return
        addr = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        message = (
            f"rank {self.rank} lost the connection to the run's store at {addr}: the process that held it"
            " (rank 0, or torchrun's agent on the first node) has ended"
        )
        self._suspect = Suspect(time.monotonic(), message, (0,))
        log.debug("rank %d: suspect: %s", self.rank, message)

    # ------------------------------------------------------------- stopping
    def _enforce(self, now: float) -> None:
        verdict = self._verdict
        assert verdict is not None
        if verdict.origin == self.rank:
            return  # this rank's own error: it ends through the exception it raised
        stuck = self.rank in verdict.stuck
        if (stuck or now - self._verdict_at >= GRACE) and self._claim_exit("watchdog"):
            children, grace = self._local.children, GRACE + 2 * INTERVAL
            shutdown.stop_process(self.rank, verdict, stuck, self._run, children, self._exit_code, grace)

    def _claim_exit(self, who: str) -> bool:
        """Whether ``who`` ends this process: the first to ask, once a failed run ends."""
        with self._lock:
            if self._exit_owner is None:
                self._exit_owner = who
            return self._exit_owner == who

    def _wait_for_children(self) -> None:
        """At exit of the launching process: after a clean run, fail if a rank it started failed."""
        if self._ended_cleanly and self._local.children:
            shutdown.wait_for_children(self.rank, self._local.children, tell_after=DEAD_AFTER)

    def _bound_exit(self) -> None:
        """At interpreter exit, before the group (and rank 0's store) goes: on rank 0, wait until the
        others have read why the run ends; after a failed run, end the process even if clean-up hangs,
        and stop this thread, or wait for its ``os._exit`` if it began first."""
        if self.rank == 0 and self._last_run is not None:
            shutdown.wait_until_settled(
                self._last_run, self._verdict, self._local.children, GRACE + 2 * INTERVAL
            )
        if self._verdict is None:
            return
        self._dead_man.arm(GRACE + DEAD_AFTER, time.monotonic(), force=True)
        if self._claim_exit("main"):
            with self._lock:
                self._run = None
            self._stop_thread()
        else:
            time.sleep(2 * (GRACE + DEAD_AFTER))  # the watchdog's os._exit, or the switch's, ends it


@functools.cache
def watchdog() -> Watchdog:
    """This process's watchdog (one per process: signals and ``os._exit`` are per process)."""
    return Watchdog()
