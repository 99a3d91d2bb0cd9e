"""A finished run exits 0 and a failed one 1: at the interpreter's last ``atexit`` handler no process
group or thread is left, and each rank says why it stopped in one line.

torchrun marked finished runs FAILED now and then: "terminate called without an active exception"
(SIGABRT) at exit, from a gloo group torn down with the interpreter after its own shutdown. A failed run
ended the same way (exit 134) when the watchdog, stopping rank 0, read rank 0's store while the main
thread's exit destroyed the group, and with it the store. The run is tests/scripts/at_exit.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import run_file


@pytest.mark.parametrize("strategy", ["mgpu_ddp", "mgpu_fsdp"])
def test_the_group_and_every_thread_are_gone_before_the_interpreter_exits(
    tmp_path: Path, strategy: str
) -> None:
    """About 10 s each: one fit on two processes."""
    result = run_file("at_exit.py", tmp_path, args=[strategy])
    assert result.returncode == 0, result.output[-3000:]
    for rank in (0, 1):
        assert (tmp_path / f"exit_rank{rank}.txt").read_text() == "group alive: False, threads: []"


def rank0_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "[rank 0]" in line]


def test_a_failed_run_exits_1_with_one_line_from_rank_0(tmp_path: Path) -> None:
    """About 15 s: the DDP guide's example; rank 1 fails at its third batch.

    Rank 0 ends by itself, through its collective's error (then the report at exit runs), or its
    watchdog ends it 3 s after it learned of the failure (``os._exit``: no report). On a loaded machine
    both at once ended rank 0 with three lines and exit status 134 (1 run in 7).
    """
    result = run_file("at_exit.py", tmp_path, args=["mgpu_ddp", "raise"])
    assert result.returncode == 1, result.output[-3000:]
    assert "terminate called" not in result.output, result.output[-3000:]
    lines = rank0_lines(result.output)
    assert len(lines) == 1, result.output[-3000:]
    assert lines[0].startswith("[rank0]: [rank 0] stopped because rank 1 (pid "), lines
    assert lines[0].endswith("failed with RuntimeError: a bad sample on rank 1. Rank 1 prints the traceback.")
    report = tmp_path / "exit_rank0.txt"
    if report.exists():  # the main thread's way: the watchdog's thread stopped before the group went
        assert report.read_text() == "group alive: False, threads: []"


def test_the_watchdogs_stop_and_the_main_threads_exit_do_not_race(tmp_path: Path) -> None:
    """About 20 s: rank 0's exit goes on once its watchdog began to stop it, as on a loaded machine.

    Rank 0 printed both its watchdog's lines and its exception's line, then aborted with 134 ("terminate
    called without an active exception") when the watchdog's wait for the other ranks read the store its
    exit had destroyed.
    """
    result = run_file("at_exit.py", tmp_path, args=["mgpu_ddp", "slow-exit"])
    rank0 = (tmp_path / "rank0.err").read_text()
    assert result.returncode == 1, rank0[-3000:]
    assert "terminate called" not in rank0, rank0[-3000:]
    assert "recvValue failed" not in rank0, rank0[-3000:]
    lines = rank0_lines(rank0)
    assert len(lines) == 1, rank0[-3000:]
    # the watchdog's line is the one the main thread prints
    assert lines[0].startswith("[rank0]: [rank 0] stopped because rank 1 (pid "), lines
    assert lines[0].endswith("failed with RuntimeError: a bad sample on rank 1. Rank 1 prints the traceback.")
