"""``mgpu_ddp``, ``mgpu_fsdp`` and ``mgpu_auto`` as SLURM starts them: ``srun`` tasks are the ranks.

Each test is one real job of two tasks on the session's one-node cluster.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from tests.slurm.cluster import SlurmCluster
from tests.slurm.jobs import batch_script, processes_of, srun_train
from tests.strategies.ddp.test_ddp import assert_same_weights
from tests.strategies.ddp.test_faults import survivor_says

pytestmark = pytest.mark.slurm

TWO_TASKS = "1 node(s) x 2 process(es) per node = 2 process(es)"


def ranks(folder: Path) -> list[dict]:
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def test_auto_picks_ddp_which_takes_its_ranks_from_slurm(slurm: SlurmCluster, tmp_path: Path) -> None:
    result = srun_train(slurm, tmp_path, "mgpu_auto")
    assert result.returncode == 0, result.output[-3000:]
    assert "mgpu_auto chose mgpu_ddp: started by SLURM" in result.output
    assert f"mgpu_ddp: {TWO_TASKS}, backend gloo, started by SLURM" in result.output
    for rank, seen in enumerate(ranks(tmp_path)):
        assert seen["slurm"]["SLURM_PROCID"] == seen["slurm"]["SLURM_LOCALID"] == str(rank)
        assert (seen["global_rank"], seen["local_rank"], seen["world_size"]) == (rank, rank, 2)
        assert (seen["environment"], seen["strategy"]) == ("SLURMEnvironment", "MGPUDDPStrategy")
    assert_same_weights(tmp_path / "result.pt")


def test_a_bare_ntasks_is_refused_with_the_fix(slurm: SlurmCluster, tmp_path: Path) -> None:
    """``--ntasks=2`` sets no ``SLURM_NTASKS_PER_NODE``: Lightning stops and names the option to use."""
    result = srun_train(slurm, tmp_path, "mgpu_ddp", layout=("--ntasks=2",))
    assert result.returncode != 0
    assert "HINT: Use `--ntasks-per-node=2` instead." in result.output, result.output[-3000:]


def test_fsdp_under_srun_matches_one_process(slurm: SlurmCluster, tmp_path: Path) -> None:
    result = srun_train(slurm, tmp_path, "mgpu_fsdp")
    assert result.returncode == 0, result.output[-3000:]
    assert f"mgpu_fsdp: {TWO_TASKS}, backend gloo, started by SLURM" in result.output
    assert [(r["global_rank"], r["world_size"], r["environment"]) for r in ranks(tmp_path)] == [
        (0, 2, "SLURMEnvironment"),
        (1, 2, "SLURMEnvironment"),
    ]
    assert_same_weights(tmp_path / "result.pt")


def test_a_killed_task_stops_the_other_and_ends_the_job(slurm: SlurmCluster, tmp_path: Path) -> None:
    """SIGKILL to one task (as the OOM killer sends it): the other rank names it and the job ends."""
    job = slurm.sbatch(batch_script(tmp_path, "mgpu_ddp", "kill"), "--job-name=killed-task")
    victim = tmp_path / "victim.pid"
    deadline = time.monotonic() + 120
    while not (victim.exists() and victim.read_text()):
        assert slurm.job_state(job) in ("PENDING", "RUNNING"), (tmp_path / "job.out").read_text()
        assert time.monotonic() < deadline, "rank 1 never reached batch 5"
        time.sleep(0.2)
    pid = int(victim.read_text())
    os.kill(pid, signal.SIGKILL)

    # the timeout only guards against a hang: what ended the job is rank 0's verdict, which it prints
    state = slurm.wait_job(job, timeout=240)
    output = (tmp_path / "job.out").read_text()
    assert state == "FAILED", output
    assert survivor_says(0, f"rank 1 (pid {pid} on {socket.gethostname()}) ended", output), output
    assert "stalled: no progress" not in output, output
    assert processes_of(tmp_path) == []
