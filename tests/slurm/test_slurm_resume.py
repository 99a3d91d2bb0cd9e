"""A SLURM job cut in the middle of an epoch is requeued and resumes exactly, once only.

The job runs ``tests/strategies/resume/scripts.SCRIPT`` under ``srun`` on two tasks with
``MGPUDDPStrategy(requeue_on_failure=1)``:

- rank 1 is SIGKILLed at step 5, after the step-3 checkpoint; rank 0 asks SLURM to requeue the job,
  and the requeued attempt (``SLURM_RESTART_COUNT=1``) resumes from that checkpoint by itself;
- every rank gets ``SIGUSR1`` from SLURM at step 5, as ``--signal=USR1@N`` sends it before a time limit:
  Lightning's ``SLURMEnvironment`` (``auto_requeue=True``, what ``mgpu_ddp`` gets under SLURM) saves
  ``hpc_ckpt_1.ckpt`` and calls ``scontrol requeue`` at the next batch start on every rank
  (``strategies/process_group/requeue.py``), in the middle of the second epoch; the requeued job runs
  the same command, which resumes from that checkpoint by itself.

Either way the job ends with the weights of the uncut run, every sample seen once per epoch.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import run_command, script_env
from tests.slurm.cluster import SlurmCluster
from tests.strategies.resume.scripts import SCRIPT

pytestmark = pytest.mark.slurm


def _submit(slurm: SlurmCluster, folder: Path, fault: str) -> tuple[str, str, str]:
    """Run the job to its end: (its id, its final state, its output).

    ``fault="signal"``: once both ranks wait at step 5, the job's tasks get ``SIGUSR1`` from SLURM, as
    ``--signal=USR1@N`` sends it before a time limit (``scancel --signal`` here: SLURM sends a time
    limit's signal from a periodic pass, up to a minute early, which could come before Lightning's handler).
    """
    (folder / "fit.py").write_text(SCRIPT)
    lines = ["#!/bin/bash", "#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=2", "#SBATCH --output=job.out"]
    lines += ["#SBATCH --requeue", "#SBATCH --open-mode=append"]
    lines.append(f"srun {sys.executable} fit.py mgpu_ddp {fault} out.pt 1")
    script = folder / "job.sbatch"
    script.write_text("\n".join(lines) + "\n")
    job = slurm.sbatch(script, f"--job-name={fault}")
    if fault == "signal":
        deadline = time.monotonic() + 120
        while not all((folder / f"waiting_rank{rank}").exists() for rank in (0, 1)):
            assert slurm.job_state(job) in ("PENDING", "RUNNING"), (folder / "job.out").read_text()
            assert time.monotonic() < deadline, "the ranks never reached step 5"
            time.sleep(0.2)
        subprocess.run(["scancel", "--signal=USR1", job], env=slurm.env(), check=True)
    state = slurm.wait_job(job, timeout=300)
    return job, state, (folder / "job.out").read_text()


@pytest.fixture(scope="module")
def uncut(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The uncut run, outside SLURM (about 15 s)."""
    folder = tmp_path_factory.mktemp("uncut")
    (folder / "fit.py").write_text(SCRIPT)
    command = [sys.executable, "fit.py", "mgpu_ddp", "none", "out.pt"]
    result = run_command(command, cwd=folder, env=script_env())
    assert result.returncode == 0, result.output[-3000:]
    return torch.load(folder / "out.pt", weights_only=True)  # type: ignore[no-any-return]


def _assert_as_uncut(folder: Path, reference: dict[str, Any]) -> None:
    out = torch.load(folder / "out.pt", weights_only=True)
    assert out["visits"] == {epoch: [1] * 16 for epoch in range(3)}
    for name, tensor in reference["weights"].items():
        torch.testing.assert_close(out["weights"][name], tensor, rtol=0, atol=1e-6, msg=name)


def _completed_after_one_requeue(slurm: SlurmCluster, folder: Path, fault: str) -> tuple[str, str]:
    """Run the job with ``fault``; it must end COMPLETED, requeued once: (its id, its output)."""
    job, state, output = _submit(slurm, folder, fault)
    assert state == "COMPLETED", output
    assert slurm.job(job)["Restarts"] == "1", output
    return job, output


def test_a_killed_task_requeues_the_job_which_finishes_as_if_uncut(
    slurm: SlurmCluster, tmp_path: Path, uncut: dict[str, Any]
) -> None:
    """About 75 s: the job's two attempts."""
    job, output = _completed_after_one_requeue(slurm, tmp_path, "step")
    assert f"mgpu_ddp: SLURM job {job} after the failed task: requeuing (requeue 1 of at most 1)" in output
    assert (
        "mgpu_ddp: attempt 2 of this job (restarted by SLURM): resuming from"
        f" {tmp_path}/ckpts/epoch=0-step=3.ckpt, saved at global step 3 (epoch 0)" in output
    )
    _assert_as_uncut(tmp_path, uncut)


def test_a_time_limit_signal_mid_epoch_requeues_the_job_which_finishes_as_if_uncut(
    slurm: SlurmCluster, tmp_path: Path, uncut: dict[str, Any]
) -> None:
    """About 75 s: SIGUSR1 at step 5; saved at step 6, batch 2 of 4 of the second epoch."""
    _, output = _completed_after_one_requeue(slurm, tmp_path, "signal")
    # the first attempt reached the step that lasts until the signal, saved after it and asked for requeue
    assert (tmp_path / "waiting_rank0").exists()
    assert (tmp_path / "waiting_rank1").exists()
    deferred = output.index(
        "SLURM's requeue signal came: every rank saves at the start of batch 2 of epoch 1 (global step 6)"
    )
    signalled = output.index("Handling auto-requeue signal: 10")
    assert signalled > deferred
    assert "Requeued SLURM job" in output[signalled:], output
    assert re.search(r"JOB \d+ ON \S+ CANCELLED AT \S+ DUE TO JOB REQUEUE", output[signalled:]), output
    checkpoint = torch.load(tmp_path / "hpc_ckpt_1.ckpt", weights_only=True)
    assert (checkpoint["epoch"], checkpoint["global_step"]) == (1, 6)

    # the second attempt found it on its own and finished the run: every sample once per epoch
    assert "mgpu_ddp: attempt 2 of this job (restarted by SLURM): resuming from" in output
    assert "saved at global step 6 (epoch 1)" in output
    restored = output.index(f"Restored all states from the checkpoint at {tmp_path / 'hpc_ckpt_1.ckpt'}")
    assert restored > signalled
    _assert_as_uncut(tmp_path, uncut)


def test_a_job_that_fails_again_is_requeued_once_only(slurm: SlurmCluster, tmp_path: Path) -> None:
    """About 60 s: rank 1 is killed at step 5 in every attempt."""
    job, state, output = _submit(slurm, tmp_path, "always")
    assert state == "FAILED", output
    assert slurm.job(job)["Restarts"] == "1", output
    assert "requeuing (requeue 1 of at most 1)" in output
    assert "not requeued: requeued 1 time(s) already, requeue_on_failure=1" in output
