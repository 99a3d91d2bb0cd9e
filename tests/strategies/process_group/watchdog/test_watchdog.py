"""The watchdog's parts on their own: how rank 0 judges heartbeats, how a process ended, signals.

The whole watchdog runs in real multi-process runs in ``test_ddp.py``; these tests pin the
decisions those runs only reach one way each.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from lightning_mgpu.strategies.process_group.watchdog.local_checks import LocalChecks, Parent
from lightning_mgpu.strategies.process_group.watchdog.processes import describe_exit, pid_status, start_time
from lightning_mgpu.strategies.process_group.watchdog.shutdown import ExitSummary
from lightning_mgpu.strategies.process_group.watchdog.signals import SignalPipe
from lightning_mgpu.strategies.process_group.watchdog.verdicts import Beat, Judge, RankInfo, Suspect, Verdict

INFOS = {r: RankInfo(r, 1000 + r, 1, "node-a", 0, f"cuda:{r}", "GPU") for r in range(3)}


def beat(seq: int, progress: int, idle: float, waiting: bool = False, done: bool = False) -> Beat:
    return Beat(seq, progress, idle, waiting, done)


def never_finished(rank: int) -> bool:
    return False


def test_a_rank_that_stops_beating_is_gone_after_dead_after() -> None:
    judge = Judge([1, 2], now=0.0, dead_after=10.0, stall_timeout=None)
    beats = {1: beat(1, 5, 0.0), 2: beat(1, 5, 0.0)}
    assert judge.look(beats, 0.0, INFOS, never_finished) is None
    beats = {1: beat(9, 9, 0.0), 2: beat(1, 5, 0.0)}  # rank 2's sequence number stays at 1
    assert judge.look(beats, 9.0, INFOS, never_finished) is None
    verdict = judge.look(beats, 10.5, INFOS, never_finished)
    assert verdict is not None
    assert verdict.message.startswith("rank 2 (pid 1002 on node-a) sent no heartbeat for 10 s")
    assert verdict.dead == (2,)


def test_a_rank_that_never_beats_is_gone_and_finished_ranks_are_not() -> None:
    judge = Judge([1, 2], now=0.0, dead_after=10.0, stall_timeout=None)
    verdict = judge.look({2: beat(1, 0, 0.0, done=True)}, 11.0, INFOS, never_finished)
    assert verdict is not None
    assert "rank 1 (pid 1001 on node-a) never sent a heartbeat" in verdict.message
    assert judge.look({2: beat(1, 0, 0.0, done=True)}, 11.0, INFOS, lambda rank: rank == 1) is None


@pytest.mark.parametrize(
    ("beats", "stuck"),
    [
        # rank 1 is behind the others, which moved on into a collective
        ({0: beat(1, 12, 31), 1: beat(1, 11, 31), 2: beat(1, 12, 31)}, (1,)),
        # all at the same count, but rank 2 alone does not wait in a collective
        ({0: beat(1, 12, 31, True), 1: beat(1, 12, 31, True), 2: beat(1, 12, 31)}, (2,)),
        # every rank waits in a collective: all are named
        ({0: beat(1, 12, 31, True), 1: beat(1, 12, 31, True), 2: beat(1, 12, 31, True)}, (0, 1, 2)),
    ],
)
def test_a_stall_names_the_ranks_that_hold_the_others(beats: dict[int, Beat], stuck: tuple[int, ...]) -> None:
    judge = Judge([1, 2], now=0.0, dead_after=100.0, stall_timeout=30.0)
    verdict = judge.look(beats, 1.0, INFOS, never_finished)
    assert verdict is not None
    assert verdict.stuck == stuck
    assert "stall_timeout=30" in verdict.message


@pytest.mark.parametrize(
    "beats",
    [
        # one rank still moves
        {0: beat(1, 12, 31), 1: beat(1, 11, 29), 2: beat(1, 12, 31)},
        # everyone busy at the same point (a long first step, compilation): not a stall
        {0: beat(1, 12, 31), 1: beat(1, 12, 31), 2: beat(1, 12, 31)},
    ],
)
def test_no_stall_while_a_rank_moves_or_all_are_busy(beats: dict[int, Beat]) -> None:
    judge = Judge([1, 2], now=0.0, dead_after=100.0, stall_timeout=30.0)
    assert judge.look(beats, 1.0, INFOS, never_finished) is None


@pytest.mark.parametrize(
    ("beats", "stuck"),
    [
        # rank 0 finished; rank 1 has waited 10 s in a collective: nobody will join it
        ({0: beat(1, 12, 0, done=True), 1: beat(1, 13, 10, True)}, (1,)),
        # rank 2 finished early; ranks 0 and 1 wait for it (rank 0 judges them all)
        ({0: beat(1, 12, 11, True), 1: beat(1, 12, 10, True), 2: beat(1, 9, 0, done=True)}, (0, 1)),
    ],
)
def test_ranks_waiting_for_a_finished_rank_are_stuck(beats: dict[int, Beat], stuck: tuple[int, ...]) -> None:
    judge = Judge([r for r in beats if r != 0], now=0.0, dead_after=10.0, stall_timeout=None)
    verdict = judge.look(beats, 1.0, INFOS, never_finished)
    assert verdict is not None
    assert verdict.stuck == stuck
    done = [r for r, b in beats.items() if b.done]
    assert f"in a collective that will never complete: rank {done[0]} has already finished the run" in (
        verdict.message
    )
    assert "different numbers of steps" in verdict.message


@pytest.mark.parametrize(
    "beats",
    [
        # a rank still in the last collective a moment after rank 0 finished
        {0: beat(1, 12, 0, done=True), 1: beat(1, 12, 9, True)},
        # rank 1 still computes (not in a collective): it may yet reach the end by itself
        {0: beat(1, 12, 11, True), 1: beat(1, 12, 11), 2: beat(1, 9, 0, done=True)},
        # every rank finished
        {0: beat(1, 12, 0, done=True), 1: beat(1, 12, 30, done=True)},
    ],
)
def test_no_rank_is_left_behind_before_it_waited_or_while_it_works(beats: dict[int, Beat]) -> None:
    judge = Judge([r for r in beats if r != 0], now=0.0, dead_after=10.0, stall_timeout=None)
    assert judge.look(beats, 1.0, INFOS, lambda rank: True) is None


def test_beats_and_infos_survive_the_store() -> None:
    assert Beat.decode(beat(3, 7, 1.25, True, False).encode().encode()) == beat(3, 7, 1.2, True, False)
    assert RankInfo.from_json(INFOS[1].to_json()) == INFOS[1]


def test_one_traceback_per_run_the_first_failed_ranks() -> None:
    first = Verdict("rank 0 (pid 1000 on node-a) failed with ValueError: bad", origin=0)
    line, traceback = first.failed(0, "ValueError: bad")
    assert "[rank 0] rank 0 (pid 1000 on node-a) failed with ValueError: bad" in line
    assert traceback is True
    line, traceback = first.failed(1, "ValueError: bad")
    assert "failed the same way as rank 0 (pid 1000 on node-a); rank 0 prints" in line
    assert traceback is False
    assert "failed with KeyError: 'x' after rank 0 (pid 1000" in first.failed(1, "KeyError: 'x'")[0]
    died = Verdict("rank 2 was killed by signal 9 (SIGKILL)", dead=(2,))
    line, traceback = died.failed(1, "KeyError: 'x'")
    assert "failed with KeyError: 'x', after rank 2 was killed" in line
    assert traceback is True
    assert "Rank 0 prints the traceback" in first.stopped(1)
    assert "prints the traceback" not in died.stopped(1)


def wait_unreaped(pid: int) -> None:
    """Wait until the child ``pid`` has exited, leaving it a zombie (WNOWAIT: not reaped)."""
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)


def test_exit_status_of_a_zombie_is_read_from_proc() -> None:
    exited = subprocess.Popen([sys.executable, "-c", "import os; os._exit(7)"])
    sleeping = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    started = start_time(sleeping.pid)
    assert pid_status(sleeping.pid, started).alive
    sleeping.kill()
    try:
        wait_unreaped(exited.pid)
        wait_unreaped(sleeping.pid)
        assert not pid_status(exited.pid).alive
        assert not pid_status(sleeping.pid, started).alive
        # not reaped yet: both are zombies whose status /proc still holds
        assert pid_status(exited.pid).returncode == 7
        assert pid_status(sleeping.pid, started).returncode == -signal.SIGKILL
    finally:
        exited.wait()
        sleeping.wait()
    assert not pid_status(sleeping.pid, started).alive


def test_local_checks_name_a_failed_child_and_the_launcher_once() -> None:
    failed = subprocess.Popen(["sh", "-c", "exit 3"])
    finished = subprocess.Popen(["true"])
    launcher = subprocess.Popen(["sh", "-c", "exit 0"])
    parent = Parent(0, launcher.pid, start_time(launcher.pid))
    local = LocalChecks(children={1: finished, 2: failed}, parent=parent)
    try:
        failed.wait()
        finished.wait()
        wait_unreaped(launcher.pid)
        verdict = local.check_children()
        assert verdict is not None
        assert (verdict.message, verdict.dead) == (f"rank 2 (pid {failed.pid}) exited with code 3", (2,))
        assert local.child_finished(1)
        assert not local.child_finished(2)
        ended = local.parent_ended()  # a zombie still: its exit status is known
        assert ended is not None
        assert ended.message == f"rank 0 (pid {launcher.pid}, which launched this rank) exited with code 0"
        assert (ended.rank, ended.returncode) == (0, 0)
        assert local.parent_ended() is None  # reported once
    finally:
        launcher.wait()


def test_a_suspect_becomes_a_verdict_that_names_the_same_ranks() -> None:
    suspect = Suspect(since=5.0, message="rank 0 ended before the run ended", dead=(0,))
    assert suspect.verdict() == Verdict("rank 0 ended before the run ended", dead=(0,))


def _raised(message: str) -> RuntimeError:
    try:
        raise RuntimeError(message)
    except RuntimeError as error:
        return error


def test_an_exit_summary_replaces_only_its_own_exception_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    summary = ExitSummary()
    summary.install()
    echoed, first, other = _raised("gloo: connection closed"), _raised("bad batch"), _raised("unrelated")
    line = "[rank 0] stopped because rank 1 failed. Rank 1 prints the traceback."
    summary.set(echoed, line, traceback=False)
    sys.excepthook(RuntimeError, echoed, echoed.__traceback__)
    assert capsys.readouterr().err == f"{line}\n"
    line = "[rank 1] rank 1 failed with RuntimeError: bad batch; its traceback follows:"
    summary.set(first, line, traceback=True)
    sys.excepthook(RuntimeError, first, first.__traceback__)
    err = capsys.readouterr().err
    assert err.startswith(f"{line}\nTraceback (most recent call last)")
    assert err.endswith("RuntimeError: bad batch\n")
    sys.excepthook(RuntimeError, other, other.__traceback__)  # not the run's: the usual traceback
    assert capsys.readouterr().err.startswith("Traceback (most recent call last)")


def test_describe_exit() -> None:
    assert describe_exit(-9) == "was killed by signal 9 (SIGKILL)"
    assert describe_exit(3) == "exited with code 3"
    assert "already collected" in describe_exit(None)


@pytest.fixture
def no_op_sigterm() -> Iterator[None]:
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    yield
    signal.signal(signal.SIGTERM, previous)


@pytest.mark.usefixtures("no_op_sigterm")
def test_a_thread_sees_sigterm_through_the_wakeup_pipe() -> None:
    pipe = SignalPipe()
    pipe.install()
    try:
        seen: list[int | None] = []
        waiter = threading.Thread(target=lambda: seen.append(pipe.wait(10.0, threading.Event())))
        waiter.start()
        os.kill(os.getpid(), signal.SIGTERM)
        waiter.join(timeout=10)
        assert seen == [signal.SIGTERM]
    finally:
        pipe.restore()
    assert signal.set_wakeup_fd(-1) == -1  # restore() gave the previous (none) back
