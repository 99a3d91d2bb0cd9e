"""``mgpu_ddp`` under faults, on real gloo processes: a rank that dies, stalls, fails or gets more batches
stops every rank on the watchdog's verdict, each rank says why, and the command fails.

Every run is tests/scripts/fault.py in its own process group (Lightning's launcher re-runs ``sys.argv``).
The tests read the script's output from a file and poll the group, so they see when the last process is
gone, not only the launching one. They assert why the run ended (the verdict each rank prints, the exit
status), never how fast: a run left waiting on stall_timeout (300 s) or gloo's 30 minutes is caught by
the pytest timeout.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import SCRIPTS, group_alive, kill_group, script_env


def survivor_says(rank: int, reason: str, output: str) -> bool:
    """Whether ``rank`` stopped naming ``reason``: in its exception, or from its watchdog."""
    return any(f"[rank {rank}] {says} {reason}" in output for says in ("stopped because", "lightning_mgpu:"))


class FaultRun:
    """tests/scripts/fault.py in its own process group, output to a file, watched until the group is gone."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.tmp_path = tmp_path
        self.out = open(tmp_path / "out.txt", "w")  # noqa: SIM115  closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPTS / "fault.py"), *args],
            cwd=tmp_path,
            env=script_env(),
            stdout=self.out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_for_fault(self, timeout: float = 180) -> tuple[float, int]:
        """Time and pid the victim wrote down just before its fault."""
        marker = self.tmp_path / "fault_at"
        deadline = time.monotonic() + timeout
        while not (marker.exists() and marker.read_text()):
            assert time.monotonic() < deadline, f"no fault within {timeout} s:\n{self.output}"
            assert group_alive(self.proc.pid), f"the run ended before its fault:\n{self.output}"
            time.sleep(0.2)
        when, pid = marker.read_text().split()
        return float(when), int(pid)

    def wait_until_gone(self) -> float:
        """Wait until no process of the run is left (the launcher stays a zombie); the time it happened.

        No upper bound: a run that does not end is caught by the pytest timeout.
        """
        while group_alive(self.proc.pid):
            time.sleep(0.2)
        return time.time()

    @property
    def output(self) -> str:
        self.out.flush()
        return (self.tmp_path / "out.txt").read_text()

    def close(self) -> None:
        kill_group(self.proc.pid)
        self.proc.wait()
        self.out.close()


@pytest.fixture
def fault_run(tmp_path: Path):
    runs: list[FaultRun] = []

    def start(*args: str) -> FaultRun:
        runs.append(FaultRun(tmp_path, *args))
        return runs[-1]

    yield start
    for run in runs:
        run.close()


@pytest.mark.parametrize(
    ("victim", "fault", "reported"),
    [
        # rank 0 launched rank 1: rank 1 reads its exit status while it is a zombie
        (0, "sigkill", "rank 0 (pid {pid}, which launched this rank) was killed by signal 9 (SIGKILL)"),
        # rank 1 is a child of rank 0, whose watchdog polls it
        (1, "sigkill", "rank 1 (pid {pid}) was killed by signal 9 (SIGKILL)"),
    ],
    ids=["rank0-killed", "rank1-killed"],
)
def test_a_dead_rank_stops_every_rank_and_is_named(fault_run, victim: int, fault: str, reported: str) -> None:
    run = fault_run(str(victim), fault, "300")
    _, pid = run.wait_for_fault()
    run.wait_until_gone()
    output = run.output
    # the verdict on the dead rank ended the run, not stall_timeout (300 s)
    assert "stalled: no progress" not in output, output
    # the surviving rank's error leads with the reason, before gloo's "Connection reset by peer"
    assert survivor_says(1 - victim, reported.format(pid=pid), output), output
    assert run.proc.wait() == (-signal.SIGKILL if victim == 0 else 1)


def test_an_error_of_the_users_code_is_named_at_once(fault_run) -> None:
    # its words ("connection", "timed out") are not a lost peer, so rank 1 does not wait for a verdict on
    # one (test_errors.py checks that judgement on this very message): it reports its own error at once
    run = fault_run("1", "raise", "300")
    run.wait_for_fault()
    run.wait_until_gone()
    output = run.output
    assert "RuntimeError: the database connection timed out" in output
    assert survivor_says(0, "rank 1", output), output
    # one line per rank, then one traceback for the run: the failed rank's, not rank 0's echo of it
    failed = "failed with RuntimeError: the database connection timed out"
    assert re.search(rf"\[rank 1\] rank 1 \(pid \d+ on .+\) {failed}; its traceback follows:", output), output
    assert output.count("Traceback (most recent call last)") == 1, output
    assert "Rank 1 prints the traceback." in output, output


def test_a_stalled_rank_is_named_and_prints_its_stack(fault_run) -> None:
    run = fault_run("1", "stall", "10")
    stalled_at, pid = run.wait_for_fault()
    gone_at = run.wait_until_gone()
    output = run.output
    assert gone_at - stalled_at >= 10, output  # not before stall_timeout
    assert f"rank 1 (pid {pid} on " in output
    assert "stalled: no progress for" in output
    assert "while rank 0 waited for it in a collective (stall_timeout=10)" in output
    stack = output.split("[rank 1] this rank is stuck here")[1]
    assert "in stall_forever" in stack.split("[rank 1] stopping")[0]
    assert survivor_says(0, f"rank 1 (pid {pid} on ", output), output


@pytest.mark.parametrize("victim", [0, 1], ids=["rank0-more", "rank1-more"])
def test_a_rank_with_more_batches_fails_the_run_with_the_reason(fault_run, victim: int) -> None:
    # Lightning's launcher let rank 0 end with exit code 0 while rank 1 hung or failed after it
    run = fault_run(str(victim), "more", "300")
    run.wait_for_fault()
    run.wait_until_gone()
    output = run.output
    # the verdict ended the run, not stall_timeout (300 s) nor gloo's 30 minutes
    assert "stalled: no progress" not in output, output
    finished = f"rank {1 - victim} has already finished the run. The ranks ran different numbers of steps"
    assert finished in output, output
    if victim == 1:
        # rank 0 destroys its process group as it exits, so rank 1's collective fails at once and its
        # error says why; a rank 1 that is not inside a collective then learns it from its watchdog
        assert (
            "[rank 1] stopped because rank 0 has already finished the run" in output
            or "[rank 1] lightning_mgpu: rank 1 waited 10 s in a collective that will never" in output
        ), output
        assert "[rank 0] lightning_mgpu: the run failed after this rank ended: rank 1 (pid " in output
    else:
        assert survivor_says(0, finished, output), output
    assert run.proc.wait() == 1


def test_a_rank_that_fails_after_the_last_collective_fails_the_command(fault_run) -> None:
    run = fault_run("1", "end", "300")
    _, pid = run.wait_for_fault()
    assert run.proc.wait() == 1, run.output
    assert "RuntimeError: saving the report failed" in run.output
    ended = f"the run failed after this rank ended: rank 1 (pid {pid}) exited with code 1"
    assert f"[rank 0] lightning_mgpu: {ended}" in run.output, run.output


def test_sigterm_ends_a_stalled_run(fault_run) -> None:
    # no stall_timeout, and gloo waits 30 minutes: only the SIGTERM ends this run before the pytest timeout
    run = fault_run("1", "stall", "none")
    run.wait_for_fault()
    time.sleep(2)  # rank 0 is now blocked in the gradient all-reduce
    os.kill(run.proc.pid, signal.SIGTERM)
    run.wait_until_gone()
    reason = f"rank 0 (pid {run.proc.pid}) received SIGTERM"
    assert f"[rank 0] lightning_mgpu: {reason}" in run.output
    assert f"[rank 1] lightning_mgpu: {reason}" in run.output  # the stuck rank heard it too
