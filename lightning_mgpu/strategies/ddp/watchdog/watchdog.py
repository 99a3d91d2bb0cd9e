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
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from lightning_mgpu.strategies.ddp.watchdog import processes
from lightning_mgpu.strategies.ddp.watchdog.heartbeats import Heartbeats
from lightning_mgpu.strategies.ddp.watchdog.signals import SignalPipe
from lightning_mgpu.strategies.ddp.watchdog.verdicts import (
    Beat,
    Judge,
    RankInfo,
    Verdict,
    finished_early,
    left_behind,
)

__all__ = ["GRACE", "INTERVAL", "Verdict", "Watchdog", "watchdog"]

INTERVAL = 1.0
"""Seconds between two checks (and two heartbeats)."""
GRACE = 3.0
"""Seconds the main thread gets to end by itself once the run must stop."""
DEAD_AFTER = 10.0
"""Seconds without a heartbeat after which a rank counts as gone."""
PARENT_PID_ENV = "LIGHTNING_MGPU_LAUNCHER_PID"
"""Set by the launcher for the ranks it starts: the pid of the launching process."""


class Watchdog:
    """The per-process watchdog; get it with :func:`watchdog`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._verdict_event = threading.Event()
        self.rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
        self._children: dict[int, subprocess.Popen] = {}
        self._parent: tuple[int, int, str | None] | None = None  # rank, pid, start time
        self._run: Heartbeats | None = None
        self._verdict: Verdict | None = None
        self._verdict_at = 0.0
        self._suspect: tuple[float, str, tuple[int, ...]] | None = None
        self._exit_code = 1
        self._last_progress: int | None = None
        self._last_change = time.monotonic()
        self._peer_started: dict[int, str | None] = {}
        self._signals = SignalPipe()
        self._dead_man = processes.DeadManSwitch()
        self._rank0_done = False
        self._progress: Callable[[], int] | None = None
        self._done_peers: list[int] = []
        self._exit_guarded = False
        self._waits_at_exit = False
        self._ended_cleanly = False

    # ----------------------------------------------------------------- set-up
    def watch_children(self, procs: list[subprocess.Popen], ranks: list[int], own_rank: int) -> None:
        """Watch the ranks this process launched (call right after starting them)."""
        self.rank = own_rank
        self._children = dict(zip(ranks, procs, strict=True))
        if not self._waits_at_exit:
            atexit.register(self._wait_for_children)
            self._waits_at_exit = True
        self._start_thread()

    def start(self, rank: int, local_rank: int) -> None:
        """Start watching as ``rank``; call from the main thread before the process group exists."""
        self.rank = rank
        self._rank0_done, self._progress, self._done_peers = False, None, []  # an earlier run's
        if self._verdict is not None and self._verdict.origin == rank:
            self._verdict = None  # an earlier run's own error, which the user caught
            self._verdict_event.clear()
        launcher_pid = os.environ.get(PARENT_PID_ENV)
        if launcher_pid and launcher_pid.isdigit() and int(launcher_pid) != os.getpid() and local_rank > 0:
            pid = int(launcher_pid)
            self._parent = (rank - local_rank, pid, processes.start_time(pid))
            if os.getppid() != pid:
                parent = rank - local_rank
                self._decide(Verdict(f"rank {parent} (pid {pid}, which launched this rank) has ended"))
        self._signals.install()
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
        # rank 0 watches every rank and judges stalls; the others only watch rank 0
        now = time.monotonic()
        if self.rank == 0:
            judge = Judge([r for r in range(1, world_size)], now, DEAD_AFTER, stall_timeout)
        else:
            judge = Judge([0], now, DEAD_AFTER, None)
        run = Heartbeats(store, self.rank, world_size, progress, stall_timeout, judge)
        run.introduce(info)
        if not self._exit_guarded:
            # registered after the process group, so it runs before the atexit handler that
            # destroys the group, which with NCCL can hang on a lost peer
            atexit.register(self._bound_exit)
            self._exit_guarded = True
        self._last_progress, self._last_change = None, time.monotonic()
        self._progress, self._rank0_done, self._ended_cleanly = progress, False, False
        self._done_peers = []
        with self._lock:
            self._run = run
        self._beat(run, time.monotonic())

    def infos(self, timeout: float = 30.0) -> dict[int, RankInfo]:
        """Every rank's :class:`RankInfo`, waiting up to ``timeout`` seconds for late ones."""
        run = self._run
        if run is None:
            return {}
        deadline = time.monotonic() + timeout
        while len(run.infos) < run.world_size and time.monotonic() < deadline:
            run.read_infos()
            if len(run.infos) < run.world_size:
                time.sleep(0.05)
        return dict(run.infos)

    def detach(self) -> None:
        """The run ended on this rank: say so, stop beating, give SIGTERM back to Lightning."""
        with self._lock:
            run, self._run = self._run, None
        if run is not None:
            with contextlib.suppress(Exception):
                run.beat(self._last_progress or 0, 0.0, waiting=False, done=True)
        self._dead_man.disarm()
        self._ended_cleanly = run is not None and self._verdict is None
        if self._verdict is None or self._verdict.origin == self.rank:
            self._stop.set()
            self._signals.wake()
            if self._thread is not None and self._thread is not threading.current_thread():
                self._thread.join(timeout=2 * INTERVAL)
            self._thread = None
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
                self._decide(Verdict(suspect[1], dead=suspect[2]))
            elif done:
                self._decide(Verdict(finished_early(done), dead=tuple(done)))
            else:
                self._signals.wake()  # check now rather than at the next tick
                self._verdict_event.wait(0.2)
        return self._verdict

    def quiet_sigterm(self) -> None:
        """Replace Lightning's SIGTERM handler (main thread only) once the run is failing.

        Lightning's handler broadcasts a tensor, which with a lost peer only fails or hangs.
        The watchdog still sees the signal and ends the process if it does not end by itself.
        """
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _note_signal)

    def report_own_error(self, message: str) -> Verdict:
        """This rank failed by itself: tell the others, but let this process end its own way."""
        return self._decide(Verdict(message, origin=self.rank))

    def _decide(self, verdict: Verdict) -> Verdict:
        with self._lock:
            if self._verdict is not None:
                return self._verdict
            self._verdict = verdict
            self._verdict_at = time.monotonic()
            run = self._run
        if run is not None:
            try:
                self._verdict = run.publish(verdict)
            except Exception:
                self._run = None
        self._verdict_event.set()
        return self._verdict

    # ---------------------------------------------------------------- thread
    def _start_thread(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lightning-mgpu-watchdog", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            signum = self._signals.wait(INTERVAL, self._stop)
            try:
                self._tick(time.monotonic(), signum)
            except Exception as err:  # the watchdog itself must never take the run down
                sys.stderr.write(f"[rank {self.rank}] lightning_mgpu watchdog: {err!r}\n")

    def _tick(self, now: float, signum: int | None = None) -> None:
        run = self._run
        if self._verdict is None:
            found = self._check_children() or self._check_parent()
            if found is not None:
                self._decide(found)
        if run is not None:
            self._exchange(run, now)
        elif self._rank0_done and self.rank != 0 and self._verdict is None:
            found = self._left_behind_rank0(now)
            if found is not None:
                self._decide(found)
        suspect = self._suspect
        if self._verdict is None and suspect is not None and now - suspect[0] >= DEAD_AFTER:
            self._decide(Verdict(suspect[1], dead=suspect[2]))
        # a signal is the reason only when nothing else is: torchrun, for one, sends SIGTERM
        # to the other ranks because one rank died
        if signum is not None and self._verdict is None:
            self._exit_code = 128 + signum
            name = signal.Signals(signum).name
            self._decide(Verdict(f"rank {self.rank} (pid {os.getpid()}) received {name}"))
        if self._verdict is not None:
            self._enforce(now)

    # ---------------------------------------------------------- local checks
    def _check_children(self) -> Verdict | None:
        for rank, proc in self._children.items():
            code = proc.poll()
            if code:
                return Verdict(f"rank {rank} (pid {proc.pid}) {processes.describe_exit(code)}", dead=(rank,))
        return None

    def _check_parent(self) -> Verdict | None:
        if self._parent is None:
            return None
        rank, pid, started = self._parent
        status = processes.pid_status(pid, started)
        if status.alive:
            return None
        self._parent = None
        what = processes.describe_exit(status.returncode)
        message = f"rank {rank} (pid {pid}, which launched this rank) {what}"
        if rank == 0:
            with self._lock:
                self._run = None  # rank 0 held the store: touching it now only prints socket errors
        if status.returncode:
            return Verdict(message, dead=(rank,))
        if not (rank == 0 and self._rank0_done):
            self._suspect = (time.monotonic(), f"{message} before the run ended", (rank,))
        return None

    def _check_same_host(self, run: Heartbeats) -> Verdict | None:
        me = run.infos.get(self.rank)
        if me is None:
            return None
        for rank, info in run.infos.items():
            if rank == self.rank or info.host != me.host or rank in self._children:
                continue
            if self._parent is not None and rank == self._parent[0]:
                continue
            if any(other.pid == info.parent_pid for other in run.infos.values()):
                continue  # launched by another rank, which reports its exact exit code
            started = self._peer_started.setdefault(rank, processes.start_time(info.pid))
            status = processes.pid_status(info.pid, started)
            if not status.alive and not run.finished(rank):
                what = processes.describe_exit(status.returncode)
                return Verdict(f"rank {rank} (pid {info.pid} on {info.host}) {what}", dead=(rank,))
        return None

    # ------------------------------------------------------------ heartbeats
    def _beat(self, run: Heartbeats, now: float) -> None:
        progress = run.progress()
        if progress != self._last_progress:
            self._last_progress, self._last_change = progress, now
        idle = now - self._last_change
        run.beat(progress, idle, waiting=idle >= 2 * INTERVAL and processes.main_thread_waits())
        if run.stall_timeout is not None:
            # if this thread cannot run (the main thread holds the GIL in C code), the
            # interpreter's C-level timer still dumps every stack and ends the process
            self._dead_man.arm(max(60.0, 2 * run.stall_timeout + DEAD_AFTER), now)

    def _exchange(self, run: Heartbeats, now: float) -> None:
        try:
            self._beat(run, now)
            published = run.abort() if self._verdict is None else None
            if published is not None:
                self._adopt(published)
            run.read_infos()
            if self._verdict is None:
                found = self._check_same_host(run)
                if found is not None:
                    self._decide(found)
            if self._verdict is None:
                found = self._judge(run, now)
                if found is not None:
                    self._decide(found)
        except Exception:
            self._store_lost(run)

    def _judge(self, run: Heartbeats, now: float) -> Verdict | None:
        # the other ranks read their own beat too, to see themselves left behind by rank 0
        beats = run.read_beats(range(run.world_size) if self.rank == 0 else [0, self.rank])
        if 0 in beats:
            self._rank0_done = beats[0].done
        self._done_peers = [r for r, b in beats.items() if b.done and r != self.rank]
        return run.judge.look(beats, now, run.infos, self._child_finished)

    def _left_behind_rank0(self, now: float) -> Verdict | None:
        """Once rank 0 finished the run and its store is gone: is this rank still waiting in a collective?"""
        if self._progress is not None:
            progress = self._progress()
            if progress != self._last_progress:
                self._last_progress, self._last_change = progress, now
        idle = now - self._last_change
        waiting = idle >= 2 * INTERVAL and processes.main_thread_waits()
        beats = {0: Beat(0, 0, 0.0, waiting=False, done=True), self.rank: Beat(0, 0, idle, waiting, False)}
        return left_behind(beats, DEAD_AFTER)

    def _child_finished(self, rank: int) -> bool:
        proc = self._children.get(rank)
        return proc is not None and proc.poll() == 0

    def _adopt(self, verdict: Verdict) -> None:
        with self._lock:
            if self._verdict is None:
                self._verdict, self._verdict_at = verdict, time.monotonic()
        self._verdict_event.set()

    def _store_lost(self, run: Heartbeats) -> None:
        with self._lock:
            if self._run is run:
                self._run = None
        found = self._check_parent()  # a dead launcher explains a lost store best
        if found is not None:
            self._decide(found)
        if self._verdict is not None or self._suspect is not None or self._rank0_done:
            return
        addr = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        message = (
            f"rank {self.rank} lost the connection to the run's store at {addr}: the process that held it"
            " (rank 0, or torchrun's agent on the first node) has ended"
        )
        self._suspect = (time.monotonic(), message, (0,))

    # ------------------------------------------------------------- stopping
    def _enforce(self, now: float) -> None:
        verdict = self._verdict
        assert verdict is not None
        if verdict.origin == self.rank:
            return  # this rank's own error: it ends through the exception it raised
        stuck = self.rank in verdict.stuck
        if stuck or now - self._verdict_at >= GRACE:
            self._exit(verdict, stuck)

    def _exit(self, verdict: Verdict, stuck: bool) -> None:
        out = sys.stderr
        out.write(f"[rank {self.rank}] lightning_mgpu: {verdict.message}\n")
        if stuck:
            out.write(f"[rank {self.rank}] this rank is stuck here (main thread, innermost call last):\n")
            out.write(processes.main_thread_stack())
        out.write(f"[rank {self.rank}] stopping this process (pid {os.getpid()}) so the run does not hang\n")
        out.flush()
        run = self._run
        with contextlib.suppress(Exception):
            if run is not None:
                run.stopping()
        deadline = time.monotonic() + GRACE + 2 * INTERVAL
        while time.monotonic() < deadline:
            children_done = all(p.poll() is not None for p in self._children.values())
            expected = run.world_size - 1 - len(verdict.dead) if run is not None else 0
            others_done = run is None or self.rank != 0 or run.stopped() >= expected
            if children_done and others_done:
                break
            time.sleep(0.1)
        for proc in self._children.values():
            if proc.poll() is None:
                with contextlib.suppress(OSError):
                    proc.kill()
                with contextlib.suppress(Exception):
                    proc.wait(timeout=5)
        os._exit(self._exit_code)

    def _wait_for_children(self) -> None:
        """At exit of the launching process after a clean run: end with an error if a rank it started failed.

        Lightning's launcher lets this process end while the ranks it started still run, so a
        rank that fails after the last collective (or that was left behind in one) would leave
        the command's exit status 0. After a failed run the watchdog stops the ranks itself.
        """
        if not self._ended_cleanly or not self._children:
            return
        # Lightning ignores Ctrl+C while it destroys the process group; a wait must stay interruptible
        with contextlib.suppress(ValueError):  # not the main thread
            signal.signal(signal.SIGINT, signal.default_int_handler)
        failed: list[str] = []
        told = False
        started = time.monotonic()
        try:
            for rank, proc in self._children.items():
                while proc.poll() is None:
                    if not told and time.monotonic() - started >= DEAD_AFTER:
                        told = True
                        sys.stderr.write(
                            f"[rank {self.rank}] lightning_mgpu: this rank finished; waiting for rank {rank}"
                            f" (pid {proc.pid}) to end\n"
                        )
                    time.sleep(0.1)
                if proc.returncode:
                    failed.append(f"rank {rank} (pid {proc.pid}) {processes.describe_exit(proc.returncode)}")
        except KeyboardInterrupt:
            for proc in self._children.values():
                if proc.poll() is None:
                    with contextlib.suppress(OSError):
                        proc.kill()
            failed.append("interrupted while waiting for the other ranks to end")
        if failed:
            reasons = "; ".join(failed)
            who = f"[rank {self.rank}] lightning_mgpu"
            sys.stderr.write(f"{who}: the run failed after this rank ended: {reasons}\n")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    def _bound_exit(self) -> None:
        """At interpreter exit after a failed run: end the process even if clean-up hangs."""
        if self._verdict is not None:
            self._dead_man.arm(GRACE + DEAD_AFTER, time.monotonic(), force=True)


def _note_signal(signum: int, frame: object) -> None:
    """A Python-level handler, so that the interpreter still reports the signal to the watchdog."""


_WATCHDOG: Watchdog | None = None


def watchdog() -> Watchdog:
    """This process's watchdog (one per process: signals and ``os._exit`` are per process)."""
    global _WATCHDOG
    if _WATCHDOG is None:
        _WATCHDOG = Watchdog()
    return _WATCHDOG
