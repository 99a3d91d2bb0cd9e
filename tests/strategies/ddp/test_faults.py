"""``mgpu_ddp`` under faults, on real gloo processes: a rank that dies, stalls, fails or gets more batches
stops every rank within seconds, each rank says why, and the command fails.

Every run is a script in its own process group (Lightning's launcher re-runs ``sys.argv``). The tests
read the script's output from a file and poll the group, so they see when the last process is gone, not
only the launching one.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import group_alive, kill_group, script_env

# A run in which one rank fails at batch 5 of 64: it dies (SIGKILL, os._exit) or stalls; or it gets
# two batches more than the others ("more"), or fails after the last collective ("end").
FAULT_SCRIPT = """
import os, sys, signal, time, torch, lightning as L
from lightning_mgpu import MGPUDDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

victim, fault = int(sys.argv[1]), sys.argv[2]
stall_timeout = None if sys.argv[3] == "none" else float(sys.argv[3])

def stall_forever():
    while True:
        time.sleep(0.1)

class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        if fault not in ("more", "end") and batch_idx == 5 and self.global_rank == victim:
            open("fault_at", "w").write(f"{time.time()} {os.getpid()}")
            if fault == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "exit":
                os._exit(7)
            if fault == "raise":
                raise RuntimeError("the database connection timed out")
            stall_forever()
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if fault == "more" and batch_idx == 5 and self.global_rank == victim:  # the others' last batch
            open("fault_at", "w").write(f"{time.time()} {os.getpid()}")

    def on_train_end(self):
        if fault == "end" and self.global_rank == victim:
            open("fault_at", "w").write(f"{time.time()} {os.getpid()}")
            raise RuntimeError("saving the report failed")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

class Shard(torch.utils.data.IterableDataset):
    def __iter__(self):
        batches = 8 if int(os.environ.get("LOCAL_RANK", 0)) == victim else 6
        return iter(TensorDataset(torch.randn(4 * batches, 4), torch.randn(4 * batches, 1)))

trainer = L.Trainer(
    accelerator="cpu", devices=2, strategy=MGPUDDPStrategy(stall_timeout=stall_timeout), max_epochs=1,
    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
)
data = Shard() if fault == "more" else TensorDataset(torch.randn(256, 4), torch.randn(256, 1))
trainer.fit(Regression(), DataLoader(data, batch_size=4))
"""


def survivor_says(rank: int, reason: str, output: str) -> bool:
    """Whether ``rank`` stopped naming ``reason``: in its exception, or from its watchdog."""
    return any(f"[rank {rank}] {says} {reason}" in output for says in ("stopped because", "lightning_mgpu:"))


class FaultRun:
    """FAULT_SCRIPT in its own process group, output to a file, watched until the group is gone."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.tmp_path = tmp_path
        (tmp_path / "fault.py").write_text(textwrap.dedent(FAULT_SCRIPT))
        self.out = open(tmp_path / "out.txt", "w")  # noqa: SIM115  closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "fault.py", *args],
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

    def seconds_until_gone(self, since: float, bound: float) -> float:
        """Seconds from ``since`` until no process of the run is left (the launcher stays a zombie)."""
        while group_alive(self.proc.pid):
            assert time.time() - since < bound, f"processes left {bound} s after the fault:\n{self.output}"
            time.sleep(0.2)
        return time.time() - since

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
    fault_at, pid = run.wait_for_fault()
    run.seconds_until_gone(fault_at, bound=30)
    output = run.output
    # the surviving rank's error leads with the reason, before gloo's "Connection reset by peer"
    assert survivor_says(1 - victim, reported.format(pid=pid), output), output
    assert run.proc.wait() == (-signal.SIGKILL if victim == 0 else 1)


def test_an_error_of_the_users_code_is_named_at_once(fault_run) -> None:
    # its words ("connection", "timed out") are not a lost peer: no waiting for a verdict on one
    run = fault_run("1", "raise", "300")
    fault_at, _ = run.wait_for_fault()
    seconds = run.seconds_until_gone(fault_at, bound=60)
    output = run.output
    assert "RuntimeError: the database connection timed out" in output
    assert survivor_says(0, "rank 1", output), output
    assert seconds < 11, (seconds, output)  # a verdict is awaited for 12 s
    # one line per rank, then one traceback for the run: the failed rank's, not rank 0's echo of it
    failed = "failed with RuntimeError: the database connection timed out"
    assert re.search(rf"\[rank 1\] rank 1 \(pid \d+ on .+\) {failed}; its traceback follows:", output), output
    assert output.count("Traceback (most recent call last)") == 1, output
    assert "Rank 1 prints the traceback." in output, output


def test_a_stalled_rank_is_named_and_prints_its_stack(fault_run) -> None:
    run = fault_run("1", "stall", "10")
    stalled_at, pid = run.wait_for_fault()
    seconds = run.seconds_until_gone(stalled_at, bound=60)
    output = run.output
    assert seconds >= 10, output  # not before stall_timeout
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
    fault_at, _ = run.wait_for_fault()
    run.seconds_until_gone(fault_at, bound=40)  # not stall_timeout (300 s), nor gloo's 30 min
    output = run.output
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
    assert run.proc.wait(timeout=60) == 1, run.output
    assert "RuntimeError: saving the report failed" in run.output
    ended = f"the run failed after this rank ended: rank 1 (pid {pid}) exited with code 1"
    assert f"[rank 0] lightning_mgpu: {ended}" in run.output, run.output


def test_sigterm_ends_a_stalled_run_within_seconds(fault_run) -> None:
    run = fault_run("1", "stall", "none")
    run.wait_for_fault()
    time.sleep(2)  # rank 0 is now blocked in the gradient all-reduce
    sent = time.time()
    os.kill(run.proc.pid, signal.SIGTERM)
    seconds = run.seconds_until_gone(sent, bound=20)
    assert seconds < 20
    reason = f"rank 0 (pid {run.proc.pid}) received SIGTERM"
    assert f"[rank 0] lightning_mgpu: {reason}" in run.output
    assert f"[rank 1] lightning_mgpu: {reason}" in run.output  # the stuck rank heard it too
