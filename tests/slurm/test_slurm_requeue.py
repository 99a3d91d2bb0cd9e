"""A job cut by its time limit: SLURM's signal, Lightning's checkpoint and requeue, nothing lost.

The job asks SLURM for ``SIGUSR1`` 30 s before its one-minute limit (``--signal=USR1@30``). SLURM
sends it from a periodic pass, so seconds off that mark (29 s after submission here, while the
run reached its long step after 8 s); asking earlier (a larger N) would risk a signal that comes
before Lightning has set its handler.
Lightning's ``SLURMEnvironment`` (``auto_requeue=True``, what ``mgpu_ddp`` gets under SLURM)
saves ``hpc_ckpt_1.ckpt`` on that signal and calls ``scontrol requeue``, at the next batch start
on every rank (``strategies/process_group/requeue.py``); the requeued job runs the same command, which
resumes from that checkpoint by itself.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.slurm.cluster import SlurmCluster
from tests.slurm.jobs import batch_script
from tests.strategies.ddp.test_ddp import assert_same_weights

pytestmark = pytest.mark.slurm


def test_a_job_cut_by_its_time_limit_is_requeued_and_resumes_with_nothing_lost(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    limits = ("--time=1", "--signal=USR1@30", "--requeue", "--open-mode=append")
    script = batch_script(tmp_path, "mgpu_ddp", "requeue", directives=limits)
    job = slurm.sbatch(script, "--job-name=requeued")
    state = slurm.wait_job(job, timeout=240)
    output = (tmp_path / "job.out").read_text()
    assert state == "COMPLETED", output
    assert slurm.job(job)["Restarts"] == "1", output

    # the first attempt reached the step that lasts until the signal, saved after it and asked for requeue
    assert (tmp_path / "waiting_rank0").exists()
    assert (tmp_path / "waiting_rank1").exists()
    deferred = output.index(
        "SLURM's requeue signal came: every rank saves at the start of batch 0 of epoch 1 (global step 8)"
    )
    signalled = output.index("Handling auto-requeue signal: 10")
    assert signalled > deferred
    assert "Requeued SLURM job" in output[signalled:], output
    assert re.search(r"JOB \d+ ON \S+ CANCELLED AT \S+ DUE TO JOB REQUEUE", output[signalled:]), output
    checkpoint = torch.load(tmp_path / "hpc_ckpt_1.ckpt", weights_only=True)
    assert (checkpoint["epoch"], checkpoint["global_step"]) == (1, 8)

    # the second attempt found it on its own and finished the run
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert (seen["attempt"], seen["slurm"]["SLURM_JOB_ID"]) == (1, job)
        assert seen["resumed_from"] == str(tmp_path / "hpc_ckpt_1.ckpt")
        assert seen["steps_run"] == 8  # epoch 1 only: epoch 0 came from the checkpoint
    restored = output.index(f"Restored all states from the checkpoint at {tmp_path / 'hpc_ckpt_1.ckpt'}")
    assert restored > signalled
    assert_same_weights(tmp_path / "result.pt")
